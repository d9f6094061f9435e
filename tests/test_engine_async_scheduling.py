"""Async scheduling (step N+1 launched before step N's tokens are read back) on CPU: what it must
not change.

Greedy tokens are checked against HF transformers' generate on SmolLM2; for the rest (seeded
sampling, stop strings and stop tokens, n > 1, logprobs, min_tokens, penalties, preemption, prefix
caching, abort) against the engine's sync mode, which the other engine tests check against HF.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, AsyncLLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    "List three primary colors:",
    "Hi",
]


@pytest.fixture(scope="module")
def async_llm(smollm2_dir):
    return LLM(
        model=smollm2_dir, dtype="float32", device="cpu", max_model_len=512, async_scheduling=True
    )


def test_cpu_defaults_to_sync_and_the_flag_is_validated(smollm2_dir, async_llm):
    assert async_llm.engine.async_scheduling is True
    from engine import EngineArgs

    assert EngineArgs(model="x").async_scheduling is None
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineArgs(model="x", async_scheduling="yes").validate()


def test_greedy_batch_matches_hf_generate(smollm2_dir, async_llm):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    outs = async_llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(ids, outs):
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=12,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()


def _mixed_params(common_ids: list[int]) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=24, logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=20, n=2),
        SamplingParams(temperature=0.0, max_tokens=30, stop=[" the", "\n"]),
        SamplingParams(
            temperature=0.8, seed=3, max_tokens=16, min_tokens=8, repetition_penalty=1.3
        ),
        SamplingParams(temperature=0.0, max_tokens=40, frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(temperature=0.7, top_k=20, seed=5, max_tokens=18, stop_token_ids=common_ids),
    ]


def _run(model_dir: str, async_scheduling: bool, prompts, params, **kw):
    llm = LLM(
        model=model_dir,
        dtype="float32",
        device="cpu",
        max_model_len=512,
        seed=1,
        async_scheduling=async_scheduling,
        **kw,
    )
    outs = llm.generate(prompts, params)
    stats = llm.stats()
    # every block came back, the dropped extra steps' too
    assert stats.num_free_blocks == stats.num_kv_blocks
    assert not llm.engine.scheduler.has_unfinished()
    return outs, stats


def test_mixed_workload_equals_sync_scheduling(smollm2_dir):
    """14 blocks of 16 tokens cannot hold every sequence at once: preemption and recompute happen in
    both modes."""
    num_kv_blocks = 14
    from transformers import AutoTokenizer

    common_ids = AutoTokenizer.from_pretrained(smollm2_dir)(" the, a. and of")["input_ids"]
    prompts = PROMPTS * 2
    params = _mixed_params(common_ids) * 2
    sync, sync_stats = _run(smollm2_dir, False, prompts, params, num_kv_blocks=num_kv_blocks)
    asyn, async_stats = _run(smollm2_dir, True, prompts, params, num_kv_blocks=num_kv_blocks)
    assert sync_stats.num_preemptions > 0 and async_stats.num_preemptions > 0
    finish_reasons = set()
    for a, b in zip(sync, asyn):
        assert len(a.outputs) == len(b.outputs)
        for x, y in zip(a.outputs, b.outputs):
            assert (y.token_ids, y.text, y.finish_reason, y.stop_reason) == (
                x.token_ids,
                x.text,
                x.finish_reason,
                x.stop_reason,
            )
            finish_reasons.add((x.finish_reason, type(x.stop_reason).__name__))
            if x.logprobs is not None:
                assert [p.keys() for p in y.logprobs] == [p.keys() for p in x.logprobs]
                assert math.isclose(
                    y.cumulative_logprob, x.cumulative_logprob, rel_tol=1e-4, abs_tol=1e-4
                )
    # the workload really ends both ways: by length, by a stop string and by a stop token id
    assert {("length", "NoneType"), ("stop", "str")} <= finish_reasons
    assert ("stop", "int") in finish_reasons


def test_a_stop_found_one_step_late_drops_the_extra_token(smollm2_dir, async_llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    free_run = async_llm.generate([PROMPTS[3]], greedy)[0].outputs[0].token_ids
    stop_id = free_run[6]
    first = free_run.index(stop_id)
    params = SamplingParams(
        temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id]
    )
    engine = async_llm.engine
    engine.add_request("stop-late", PROMPTS[3], params)
    finished = None
    while finished is None:
        for out in engine.step():
            if out.finished:
                finished = out
    assert finished.outputs[0].token_ids == free_run[: first + 1]
    assert (finished.outputs[0].finish_reason, finished.outputs[0].stop_reason) == ("stop", stop_id)
    stats = engine.stats()
    # freed when the stop was seen, with a step still in flight
    assert stats.num_free_blocks == stats.num_kv_blocks
    engine.step()  # reads back the dropped step: nothing comes of it
    assert not engine.has_unfinished()


async def test_abort_with_a_step_in_flight_frees_blocks_and_ends_the_stream(smollm2_dir):
    engine = AsyncLLM(
        model=smollm2_dir,
        dtype="float32",
        device="cpu",
        max_model_len=256,
        num_kv_blocks=64,
        async_scheduling=True,
    )
    try:
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        gen = engine.generate("long", list(range(100, 160)), long)
        first = await gen.__anext__()
        assert not first.finished
        await engine.abort("long")
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_kv_blocks
        final = first
        async for final in gen:
            pass
        assert final.finished and final.outputs[0].finish_reason == "abort"
        # the same id again: a fresh request, never the old one's tokens
        expected = (
            LLM(
                model=smollm2_dir,
                dtype="float32",
                device="cpu",
                max_model_len=256,
                num_kv_blocks=64,
            )
            .generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=6))[0]
            .outputs[0]
            .token_ids
        )
        out = None
        async for out in engine.generate(
            "long", "Hello", SamplingParams(temperature=0.0, max_tokens=6)
        ):
            pass
        assert out.finished and out.outputs[0].token_ids == expected
    finally:
        engine.shutdown()


def test_prefix_cache_blocks_published_late_serve_the_same_tokens(smollm2_dir):
    """Blocks whose last token was still on the device are published once it is read; a later
    identical prompt hits them and decodes the same tokens."""
    llm = LLM(
        model=smollm2_dir, dtype="float32", device="cpu", max_model_len=512, async_scheduling=True
    )
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = llm.generate([PROMPTS[3]], params)[0]
    # prompt + generated blocks, then more
    follow = first.prompt_token_ids + first.outputs[0].token_ids[:36]
    again = llm.generate([follow], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[
        0
    ]
    # every full block of it, as sync gives
    assert again.num_cached_tokens == 16 * ((len(follow) - 1) // 16)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids[36:40]


def test_a_failed_launch_after_a_penalty_flush_loses_no_output(smollm2_dir):
    """With penalties the step in flight is read back before scheduling; when the next launch then
    runs out of memory, the outputs already read go out with the next step (a finished request must
    not be lost)."""
    from engine.core import RequestFailed

    llm = LLM(
        model=smollm2_dir, dtype="float32", device="cpu", max_model_len=512, async_scheduling=True
    )
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=2, repetition_penalty=1.2, ignore_eos=True)
    expected = (
        LLM(model=smollm2_dir, dtype="float32", device="cpu", max_model_len=512)
        .generate([PROMPTS[0]], params)[0]
        .outputs[0]
        .token_ids
    )
    real_execute = engine.runner.execute

    # refuses any step that prefills more than 100 tokens at once
    def execute(scheduled, rows, *previous):
        if any(s.num_new_tokens > 100 for s in scheduled):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real_execute(scheduled, rows, *previous)

    engine.runner.execute = execute
    engine.add_request("small", PROMPTS[0], params)
    engine.step()
    # "small": its last token in flight, with a penalty, so the next step reads it back first
    engine.step()
    engine.add_request("big", "word " * 150, SamplingParams(temperature=0.0, max_tokens=2))
    failed, finals = [], {}
    while engine.has_unfinished():
        try:
            outs = engine.step()
        except RequestFailed as exc:
            failed.append(exc.request_id)
            continue
        finals.update({o.request_id: o for o in outs if o.finished})
    assert failed == ["big"]
    assert finals["small"].outputs[0].token_ids == expected


def test_capture_cuda_graphs_is_a_no_op_on_cpu(async_llm):
    assert async_llm.capture_cuda_graphs() == 0.0
