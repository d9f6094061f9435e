"""Decode graphs captured off the step loop (GPU): from the worker's ready on, a step whose batch
size has no graph yet replays a larger captured graph or runs eagerly while another thread captures
its size (at once when the kernel set is loaded, else after the size's first eager step loaded its
kernels); the tokens are those of graphs captured inline and of eager decoding.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from conftest import free_gpu_memory
from engine import LLM, SamplingParams
from tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPTS = [[3 + i, 11, 7 * i % 50 + 1, 19] * (1 + i) for i in range(8)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


# the engine every test here runs (through LLM, or through the start sequence)
ENGINE = dict(
    dtype="bfloat16",
    max_model_len=128,
    max_num_seqs=8,
    gpu_memory_utilization=0.3,
    cuda_graph_sizes=[1, 2, 4, 8],
)


def _llm(model_dir: str, **kw) -> LLM:
    return LLM(model=model_dir, device="cuda", **ENGINE, **kw)


def _wait_captured(graphs, sizes, timeout=120.0) -> None:
    deadline = time.monotonic() + timeout
    while not set(sizes) <= set(graphs.graphs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(sizes) <= set(graphs.graphs), sorted(graphs.graphs)


def test_background_capture_gives_the_tokens_of_inline_capture_and_eager(tmp_path):
    from warmup.ready import warm_kernels

    model_dir = str(tmp_path / "m")
    make_tiny_model("qwen3", model_dir)
    tokens = {}
    for name, kw in (
        ("eager", dict(enforce_eager=True)),
        ("inline", dict(cuda_graph_capture="start")),
    ):
        llm = _llm(model_dir, **kw)
        tokens[name] = [
            [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:n], GREEDY)] for n in (1, 3, 8)
        ]
        del llm
        free_gpu_memory()
    llm = _llm(model_dir)
    warm = warm_kernels(llm)
    assert llm.engine.runner.graphs.background  # from ready on, before the set is loaded
    assert warm.loaded.wait(600)
    graphs = llm.engine.runner.graphs
    # the set preloaded: a size is captured without an eager step first
    assert graphs.kernels_loaded and warm.skipped == 0, warm.summary()
    # nothing captured yet, nothing captured inline
    assert graphs.background and graphs.graphs == {}
    tokens["background"] = [
        [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:n], GREEDY)] for n in (1, 3, 8)
    ]
    _wait_captured(graphs, [1, 4, 8])
    tokens["replayed"] = [
        [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:n], GREEDY)] for n in (1, 3, 8)
    ]
    assert tokens["background"] == tokens["inline"] == tokens["eager"] == tokens["replayed"]
    del llm, graphs
    free_gpu_memory()


def test_a_step_without_its_graph_replays_a_larger_one_and_queues_its_size(tmp_path):
    model_dir = str(tmp_path / "m")
    make_tiny_model("llama", model_dir)
    llm = _llm(model_dir)
    graphs = llm.engine.runner.graphs
    graphs.capture([8])
    # the tiny model's kernels are loaded by the capture above
    graphs.kernels_loaded = True
    graphs.background = True
    replays = []
    original = graphs.graphs[8].replay
    # (noqa: pyflakes reads the lambda after the `del` below; it only runs before it)
    graphs.graphs[8].replay = lambda: (replays.append(8), original())[1]  # noqa: F821
    expected = [o.outputs[0].token_ids for o in _outputs(llm, 3)]
    assert replays, "batch 3 ran from the graph of 8 while 4 was captured"
    _wait_captured(graphs, [4])
    assert [o.outputs[0].token_ids for o in _outputs(llm, 3)] == expected
    del llm, graphs, original
    free_gpu_memory()


def test_before_the_set_is_loaded_a_size_runs_eagerly_then_is_captured_off_the_loop(
    tmp_path, caplog
):
    """As at ready, before the kernel set's background load ends (kernels_loaded off), a size is
    queued only after a step ran at it eagerly; no capture happens on the step loop."""
    model_dir = str(tmp_path / "m")
    make_tiny_model("llama", model_dir)
    eager = _llm(model_dir, enforce_eager=True)
    expected = [[o.outputs[0].token_ids for o in _outputs(eager, n)] for n in (1, 3, 8)]
    del eager
    free_gpu_memory()
    llm = _llm(model_dir)
    graphs = llm.engine.runner.graphs
    graphs.background = True
    eager_sizes = []

    def counted(batch, *a, pad=graphs.padded_size, run=graphs._run_eager):
        eager_sizes.append(pad(batch))
        return run(batch, *a)

    graphs._run_eager = counted
    with caplog.at_level("INFO", logger="engine.cuda_graphs"):
        first = [[o.outputs[0].token_ids for o in _outputs(llm, n)] for n in (1, 3, 8)]
        _wait_captured(graphs, [1, 4, 8])
        again = [[o.outputs[0].token_ids for o in _outputs(llm, n)] for n in (1, 3, 8)]
    assert not graphs.kernels_loaded
    assert {1, 4, 8} <= set(eager_sizes) and set(eager_sizes) <= set(graphs.graphs)
    assert first == again == expected
    captures = [r.getMessage() for r in caplog.records if "captured decode batch" in r.getMessage()]
    assert len(captures) == len(graphs.graphs), captures
    assert all("in the background" in line for line in captures), captures
    del llm, graphs, counted
    free_gpu_memory()


def test_from_the_starts_ready_on_no_capture_runs_on_the_step_loop(tmp_path, caplog):
    """The start sequence (warmup.start, as the entry points run it) turns background capture on
    at ready: the first request's decode size is captured off the loop, its tokens are eager's."""
    from warmup.start import StartArgs, start_engine

    model_dir = str(tmp_path / "m")
    make_tiny_model("llama", model_dir)
    eager = _llm(model_dir, enforce_eager=True)
    expected = _outputs(eager, 1)[0].outputs[0].token_ids
    del eager
    free_gpu_memory()
    args = StartArgs(
        model=model_dir, cache_dir=str(tmp_path / "cache"), device="cuda", engine_options=ENGINE
    )
    start = start_engine(args)
    engine = start.future.result(timeout=300)
    graphs = engine.engine.runner.graphs
    try:
        assert graphs.background and graphs.graphs == {}
        with caplog.at_level("INFO", logger="engine.cuda_graphs"):
            tokens = asyncio.run(_first_tokens(engine, PROMPTS[0]))
            _wait_captured(graphs, [1])
        assert tokens == expected
        captures = [
            r.getMessage() for r in caplog.records if "captured decode batch" in r.getMessage()
        ]
        assert captures and all("in the background" in line for line in captures), captures
    finally:
        engine.shutdown()
        start.join_background(60)
    del engine, graphs
    free_gpu_memory()


async def _first_tokens(engine, prompt) -> list[int]:
    out = None
    async for out in engine.generate("r", prompt, GREEDY):
        pass
    return out.outputs[0].token_ids


def _outputs(llm, n):
    return llm.generate(PROMPTS[:n], GREEDY)
