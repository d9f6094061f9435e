"""Bad input gets a precise ValueError naming the field, and the engine goes on serving everybody
else."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from engine import LLM, AsyncLLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(model=smollm2_dir, dtype="float32", device="cpu", max_model_len=64, num_kv_blocks=32)


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: SamplingParams(temperature=-1), "temperature"),
        (lambda: SamplingParams(top_p=0), "top_p"),
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(top_k=-5), "top_k"),
        (lambda: SamplingParams(n=0), "n"),
        (lambda: SamplingParams(logprobs=1000), "logprobs"),
        (lambda: SamplingParams(min_tokens=10, max_tokens=5), "min_tokens"),
        (lambda: SamplingParams(stop=["x"] * 10_000), "stop"),
    ],
)
def test_invalid_sampling_params_name_the_field(make, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        make()


def test_prompt_over_max_model_len_fails_alone(llm):
    good = llm.generate(["Hello there"], GREEDY)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"prompt: 80 tokens .*max_model_len=64"):
        llm.generate([list(range(100, 180))], GREEDY)
    with pytest.raises(ValueError, match=r"prompt_token_ids: .*\[0, 49152\)"):
        llm.generate([[1, 2, 10**9]], GREEDY)
    with pytest.raises(ValueError, match=r"prompt: must not be empty"):
        llm.generate([[]], GREEDY)
    # a batch with one bad prompt is refused before anything runs, and the engine is still whole
    with pytest.raises(ValueError, match=r"max_model_len"):
        llm.generate(["Hello there", list(range(100, 180))], GREEDY)
    stats = llm.stats()
    assert (
        stats.num_running == 0
        and stats.num_waiting == 0
        and stats.num_free_blocks == stats.num_kv_blocks
    )
    assert llm.generate(["Hello there"], GREEDY)[0].outputs[0].token_ids == good


def test_prompt_larger_than_the_whole_cache_is_refused(smollm2_dir):
    eng = LLM(
        model=smollm2_dir,
        dtype="float32",
        device="cpu",
        max_model_len=512,
        block_size=16,
        num_kv_blocks=4,
    )
    with pytest.raises(
        ValueError, match=r"prompt: 70 tokens need 5 KV blocks but the whole cache has 4"
    ):
        eng.generate([list(range(100, 170))], GREEDY)
    out = eng.generate([list(range(100, 150))], SamplingParams(temperature=0.0, ignore_eos=True))[
        0
    ].outputs[0]
    # the cache is the context limit
    assert out.finish_reason == "length" and len(out.token_ids) == 64 - 50


def _copy_model(src: str, dst, edit_config=None, drop_tensor: str | None = None) -> str:
    shutil.copytree(src, dst)
    if edit_config:
        path = os.path.join(dst, "config.json")
        cfg = json.load(open(path))
        edit_config(cfg)
        json.dump(cfg, open(path, "w"))
    if drop_tensor:
        path = os.path.join(dst, "model.safetensors")
        state = load_file(path)
        del state[drop_tensor]
        save_file(state, path)
    return str(dst)


def test_unknown_architecture_is_refused_with_the_supported_list(smollm2_dir, tmp_path):
    bad = _copy_model(
        smollm2_dir,
        tmp_path / "m",
        edit_config=lambda c: c.update(architectures=["GPT2LMHeadModel"]),
    )
    with pytest.raises(
        ValueError,
        match=r"unsupported architecture.*GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM",
    ):
        LLM(model=bad, device="cpu")


def test_missing_weight_is_named(smollm2_dir, tmp_path):
    bad = _copy_model(smollm2_dir, tmp_path / "m", drop_tensor="model.layers.3.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.up_proj\.weight"):
        LLM(model=bad, device="cpu")


async def test_async_bad_requests_fail_alone(smollm2_dir):
    engine = AsyncLLM(
        model=smollm2_dir, dtype="float32", device="cpu", max_model_len=64, num_kv_blocks=32
    )
    try:

        async def run(rid, prompt, params):
            out = None
            async for out in engine.generate(rid, prompt, params):
                pass
            return out

        results = await asyncio.gather(
            run("ok-1", "Hello there", GREEDY),
            run("too-long", list(range(100, 180)), GREEDY),
            run("ok-2", "Good morning", GREEDY),
            run("bad-ids", [5, -1], GREEDY),
            return_exceptions=True,
        )
        assert results[0].finished and len(results[0].outputs[0].token_ids) == 6
        assert isinstance(results[1], ValueError) and "max_model_len" in str(results[1])
        assert results[2].finished and len(results[2].outputs[0].token_ids) == 6
        assert isinstance(results[3], ValueError) and "prompt_token_ids" in str(results[3])
        gen = engine.generate(
            "dup", "a", SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        )
        await gen.__anext__()
        with pytest.raises(ValueError, match="request_id: 'dup' is already in use"):
            await engine.generate("dup", "b", GREEDY).__anext__()
        await gen.aclose()
        assert engine.errored is None
    finally:
        engine.shutdown()
