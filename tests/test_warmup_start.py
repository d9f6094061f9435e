"""The one start sequence (warmup.start) from plain arguments: its phases in order, the weights
moving before torch is imported, and resolve failures that say which reference failed.

References: the engine built directly (engine.LLM) from the same directory gives the same greedy
tokens.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from cache.device_stream import cuda_ordinal
from engine import LLM, SamplingParams, tokenizer as tokenizer_module
from tests.tiny_models import add_char_tokenizer, make_tiny_model
from warmup.start import EngineStart, ResolveError, StartArgs, start_engine

ORDER = [
    "before_boot",
    "resolve",
    "stream_start",
    "tokenizer",
    "cuda_context",
    "entry_imports",
    "import_torch",
    "preload_start",
    "engine_mode",
    "import_engine",
    "engine",
    "total",
]
TEXT = chr(0x103) + chr(0x104)  # add_char_tokenizer's tokens 3 and 4
GREEDY = dict(temperature=0.0, max_tokens=4, ignore_eos=True)


async def _greedy(engine, prompt: list[int]) -> list[int]:
    out = None
    async for out in engine.generate("r", prompt, SamplingParams(**GREEDY)):
        pass
    return out.outputs[0].token_ids


TINY_OPTIONS = {"dtype": "float32", "num_kv_blocks": 32, "block_size": 4, "max_model_len": 64}


def _tiny_start_args(tmp_path, **fields) -> StartArgs:
    """StartArgs for a tiny llama written under tmp_path/model, on the CPU."""
    model_dir = str(tmp_path / "model")
    make_tiny_model("llama", model_dir)
    fields.setdefault("model", model_dir)
    return StartArgs(
        cache_dir=str(tmp_path / "cache"), device="cpu", engine_options=TINY_OPTIONS, **fields
    )


def test_a_local_model_starts_through_every_phase_in_order(tmp_path):
    args = _tiny_start_args(tmp_path, engine_mode="auto")
    model_dir = args.model
    start = start_engine(args)
    assert start.wait_streaming(60)
    engine = start.future.result(timeout=300)
    try:
        assert list(start.phases) == ORDER
        assert start.weight_stream == "prefetch" and str(start.model_dir) == model_dir
        assert start.selection.mode == "jit"  # auto on CPU: no compiled engine
        reference = LLM(model=model_dir, device="cpu", **TINY_OPTIONS)
        expected = reference.generate([[3, 5, 7, 9]], SamplingParams(**GREEDY))[0].outputs[0]
        assert asyncio.run(_greedy(engine, [3, 5, 7, 9])) == expected.token_ids
    finally:
        engine.shutdown()


def test_the_entry_points_imports_come_before_torch_which_waits_for_them(tmp_path):
    args = _tiny_start_args(tmp_path)
    start = EngineStart(args).hold_for_entry_imports().begin()
    assert start.wait_streaming(60)
    with start.entry_imports():
        time.sleep(0.3)  # the start makes no context on the CPU, then waits
        seen = list(start.phases)
    engine = start.future.result(timeout=300)
    try:
        assert seen[-1] == "cuda_context"  # not import_torch: it waits for the block
        assert start.phases["entry_imports"] >= 0.2
        phases = list(start.phases)
        assert phases.index("entry_imports") < phases.index("import_torch")
    finally:
        engine.shutdown()


def test_the_tokenizer_is_loaded_before_torch_and_the_engine_takes_that_one(tmp_path, monkeypatch):
    args = _tiny_start_args(tmp_path)
    add_char_tokenizer(args.model)
    loads = []
    real_load = tokenizer_module.Tokenizer._load.__func__

    def counted(cls, path, chat_template):
        loads.append(time.perf_counter())
        return real_load(cls, path, chat_template)

    monkeypatch.setattr(tokenizer_module.Tokenizer, "_load", classmethod(counted))
    start = start_engine(args)
    engine = start.future.result(timeout=300)
    try:
        phases = list(start.phases)
        assert phases.index("tokenizer") < phases.index("import_torch")
        assert len(loads) == 1  # the preload; the engine's build took it instead of loading again
        assert engine.tokenizer is not None and engine.tokenizer.encode(TEXT) == [3, 4]
        assert tokenizer_module._preload_key(args.model, None) not in tokenizer_module._preloaded
    finally:
        engine.shutdown()


def test_a_start_that_fails_after_the_tokenizer_leaves_no_preload_behind(tmp_path, monkeypatch):
    # the preload is dropped before the start's future wakes its waiter: a slow drop (0.2 s here)
    # is still done when the waiter looks (CI's full suite once found it not yet dropped)
    import warmup.start as start_module

    drop = start_module.discard_tokenizer

    def slow_drop(*a):
        time.sleep(0.2)
        drop(*a)

    monkeypatch.setattr(start_module, "discard_tokenizer", slow_drop)
    args = _tiny_start_args(tmp_path)
    add_char_tokenizer(args.model)
    bad = StartArgs(
        model=args.model,
        cache_dir=args.cache_dir,
        device="cpu",
        engine_options=dict(TINY_OPTIONS, max_model_len=0),  # the engine refuses it
    )
    start = start_engine(bad)
    with pytest.raises(ValueError, match="max_model_len"):
        start.future.result(timeout=300)
    assert "tokenizer" in start.phases
    assert tokenizer_module._preload_key(args.model, None) not in tokenizer_module._preloaded


def test_a_preloaded_tokenizer_is_handed_out_once_and_only_for_its_arguments(tmp_path):
    model_dir = str(tmp_path / "model")
    make_tiny_model("llama", model_dir)
    add_char_tokenizer(model_dir)
    assert tokenizer_module.preload(model_dir)
    other_template = "{{ messages[0]['content'] }}"
    fresh = tokenizer_module.Tokenizer.from_dir(model_dir, chat_template=other_template)
    assert fresh.chat_template == other_template  # another template: loaded afresh
    first = tokenizer_module.Tokenizer.from_dir(str(tmp_path / "model" / "."))  # the same dir
    second = tokenizer_module.Tokenizer.from_dir(model_dir)
    assert first is not second and first.encode(TEXT) == second.encode(TEXT) == [3, 4]


def test_a_tokenizer_that_cannot_load_is_left_to_the_engine_to_report(tmp_path):
    assert not tokenizer_module.preload(str(tmp_path))  # no tokenizer.json
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert not tokenizer_module.preload(str(tmp_path))
    assert tokenizer_module._preload_key(str(tmp_path), None) not in tokenizer_module._preloaded
    with pytest.raises(Exception, match="(?i)expected|json|key"):
        tokenizer_module.Tokenizer.from_dir(str(tmp_path))


def test_the_context_is_made_on_the_device_the_setting_names():
    assert [cuda_ordinal(d) for d in ("auto", "cuda", "cuda:0", "cuda:3")] == [0, 0, 0, 3]
    assert [cuda_ordinal(d) for d in ("cpu", "mps", "cuda:x")] == [None, None, None]


def test_a_download_does_not_hold_the_entry_points_imports(tmp_path):
    gate = threading.Event()

    def locate() -> str:  # a download that has not finished
        gate.wait(60)
        raise FileNotFoundError("not there")

    start = (
        EngineStart(StartArgs(model="slow", cache_dir=str(tmp_path), device="cpu", locate=locate))
        .hold_for_entry_imports()
        .begin()
    )
    assert not start.wait_streaming(0.2)
    t0 = time.perf_counter()
    with start.entry_imports():
        pass
    assert time.perf_counter() - t0 < 1.0
    gate.set()
    with pytest.raises(ResolveError):
        start.future.result(timeout=60)
    assert "entry_imports" not in start.phases


def test_a_reference_that_does_not_resolve_fails_naming_it(tmp_path):
    missing = str(tmp_path / "no-such-model")
    start = EngineStart(StartArgs(model=missing, cache_dir=str(tmp_path / "cache"), device="cpu"))
    start.begin()
    assert start.wait_streaming(60)  # a failure before the stream releases the caller too
    with pytest.raises(ResolveError) as err:
        start.future.result(timeout=60)
    assert err.value.role == "model" and err.value.ref == missing and missing in str(err.value)
    assert list(start.phases) == ["before_boot", "resolve"] and start.weight_stream is None


def test_locate_finds_the_model_instead_of_the_cache(tmp_path):
    calls = []

    def locate() -> str:
        calls.append(1)
        raise FileNotFoundError("the demo wheel is missing")

    start = EngineStart(
        StartArgs(model="demo", cache_dir=str(tmp_path), device="cpu", locate=locate)
    ).begin()
    with pytest.raises(ResolveError, match="the demo wheel is missing"):
        start.future.result(timeout=60)
    assert calls == [1]


@pytest.mark.parametrize("outcome", ["ready", "failed"])
def test_the_garbage_collector_is_off_during_the_start_and_back_on_after(tmp_path, outcome):
    import gc

    gate = threading.Event()

    def locate() -> str:  # the start waits here until the test has looked
        gate.wait(60)
        if outcome == "failed":
            raise FileNotFoundError("no model here")
        return str(tmp_path / "model")

    args = _tiny_start_args(tmp_path, model="located", locate=locate)
    assert gc.isenabled()
    start = EngineStart(args).begin()
    during = gc.isenabled()
    gate.set()
    try:
        engine = start.future.result(timeout=300)
    except ResolveError:
        engine = None
    assert (engine is None) == (outcome == "failed")
    assert not during and gc.isenabled()
    assert gc.get_freeze_count() > 0  # what the start made is out of the collector's reach
    gc.unfreeze()
    if engine is not None:
        engine.shutdown()


def test_an_engine_shut_down_before_serving_is_let_go(tmp_path):
    # the background kernel warm-up waits for a first request; a shut-down engine ends that wait,
    # so nothing holds the engine (on a GPU: its KV cache) once its owner drops it
    import gc
    import weakref

    args = _tiny_start_args(tmp_path)
    engine = start_engine(args).future.result(timeout=300)
    gone = weakref.ref(engine)
    engine.shutdown()
    del engine
    deadline = time.monotonic() + 10
    while any(t.name == "coldbrew-kernels" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the kernel warm-up still waits on a shut-down engine"
        time.sleep(0.1)
    gc.unfreeze()
    gc.collect()
    assert gone() is None


def test_shutdown_can_wait_for_the_background_work_to_end(tmp_path):
    # `serve` joins the start's background threads after the engine's shutdown, then exits without
    # finalising the interpreter: the join returns True once they saw the engine stopped
    import gc

    start = start_engine(_tiny_start_args(tmp_path))
    engine = start.future.result(timeout=300)
    assert not start.join_background(0.2)  # the warm-up waits for a first request meanwhile
    engine.shutdown()
    assert start.join_background(10.0)
    gc.unfreeze()
