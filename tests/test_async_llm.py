"""AsyncLLM: per-request streams of cumulative outputs, the same tokens as LLM, and abort that frees
blocks at once."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import LLM, AsyncLLM, EngineArgs, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def add(a, b):",
    "Once upon a time",
    "Colors of the rainbow:",
]


@pytest.fixture(scope="module")
def sync_llm(smollm2_dir):
    return LLM(model=smollm2_dir, dtype="float32", device="cpu", max_model_len=256)


async def test_streams_are_cumulative_and_match_llm(smollm2_dir, sync_llm):
    params = SamplingParams(temperature=0.0, max_tokens=16, stop=[" Paris is"])
    expected = sync_llm.generate(PROMPTS, params)
    args = EngineArgs(model=smollm2_dir, dtype="float32", device="cpu", max_model_len=256)
    engine = AsyncLLM.from_engine_args(args)
    try:

        async def stream(i):
            seen = []
            async for out in engine.generate(f"req-{i}", PROMPTS[i], params):
                seen.append(out)
            return seen

        streams = await asyncio.gather(*(stream(i) for i in range(len(PROMPTS))))
        for exp, seen in zip(expected, streams):
            final = seen[-1]
            assert final.finished and all(not s.finished for s in seen[:-1])
            assert final.outputs[0].token_ids == exp.outputs[0].token_ids
            assert final.outputs[0].text == exp.outputs[0].text
            for a, b in zip(seen, seen[1:]):  # cumulative: each update extends the previous one
                assert (
                    b.outputs[0].token_ids[: len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
                )
                assert b.outputs[0].text.startswith(a.outputs[0].text)
            for s in seen:  # a stop string is never shown, not even in part
                assert " Paris is" not in s.outputs[0].text
    finally:
        engine.shutdown()


async def test_abort_frees_blocks_at_once(smollm2_dir):
    engine = AsyncLLM(
        model=smollm2_dir, dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=64
    )
    try:
        total = engine.stats().num_kv_blocks
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        gen = engine.generate("long", list(range(100, 160)), long)
        first = await gen.__anext__()
        assert not first.finished
        assert engine.stats().num_free_blocks < total
        await engine.abort("long")
        assert engine.stats().num_free_blocks == total  # freed before abort returned
        final = None
        async for final in gen:
            pass
        assert final is not None and final.finished and final.outputs[0].finish_reason == "abort"
        # the engine keeps serving
        out = None
        async for out in engine.generate(
            "next", "Hello", SamplingParams(temperature=0.0, max_tokens=4)
        ):
            pass
        assert out.finished
    finally:
        engine.shutdown()


async def test_a_client_that_goes_away_releases_its_request(smollm2_dir):
    engine = AsyncLLM(
        model=smollm2_dir, dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=64
    )
    try:
        gen = engine.generate(
            "gone",
            list(range(100, 140)),
            SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True),
        )
        await gen.__anext__()
        await gen.aclose()  # the stream is closed early, as an HTTP client disconnecting does
        stats = engine.stats()
        assert stats.num_running == 0 and stats.num_waiting == 0
        assert stats.num_free_blocks == stats.num_kv_blocks
    finally:
        engine.shutdown()


async def test_out_of_memory_fails_only_the_request_that_asked_for_it(smollm2_dir, sync_llm):
    """The device running out of memory on a big prefill ends that request with an error naming the
    cause; the small requests beside it finish with their usual tokens and the engine stays up (no
    retry loop)."""
    params = SamplingParams(temperature=0.0, max_tokens=8)
    expected = sync_llm.generate(PROMPTS[:2], params)
    args = EngineArgs(model=smollm2_dir, dtype="float32", device="cpu", max_model_len=256)
    engine = AsyncLLM.from_engine_args(args)
    runner = engine.engine.runner
    real_execute = runner.execute
    big_prompt = "word " * 150

    # the device refuses any step that prefills over 100 tokens at once
    def execute(scheduled, rows, *previous):
        if any(s.num_new_tokens > 100 for s in scheduled):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real_execute(scheduled, rows, *previous)

    runner.execute = execute
    try:

        async def final(rid, prompt):
            last = None
            async for out in engine.generate(rid, prompt, params):
                last = out
            return last

        results = await asyncio.gather(
            final("small-0", PROMPTS[0]),
            final("big", big_prompt),
            final("small-1", PROMPTS[1]),
            return_exceptions=True,
        )
        assert isinstance(results[1], RuntimeError) and "out of device memory" in str(results[1])
        for exp, got in zip(expected, (results[0], results[2])):
            assert got.outputs[0].token_ids == exp.outputs[0].token_ids
        stats = engine.engine.stats()
        assert stats.num_running == 0 and stats.num_waiting == 0
        again = await final("after", PROMPTS[0])  # the engine still serves
        assert again.outputs[0].token_ids == expected[0].outputs[0].token_ids
    finally:
        runner.execute = real_execute
        engine.shutdown()
