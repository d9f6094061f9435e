"""End-to-end logits parity: every supported family through the whole engine (scheduler, chunked
prefill, paged KV cache, runner, sampler) against HF transformers' full recompute, in float32.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tiny_models import FAMILIES, hf_logits, make_tiny_model

BOUND = 1e-4  # max abs difference of log-probabilities, float32
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_and_16_decode_steps_match_hf(family, device, tmp_path):
    hf = make_tiny_model(family, str(tmp_path))
    # 16-token budget: the 40-token prompts are prefilled in chunks
    llm = LLM(
        model=str(tmp_path),
        dtype="float32",
        device=device,
        block_size=4,
        num_kv_blocks=64,
        max_num_batched_tokens=16,
    )
    # never-written cache memory must never leak into a result
    llm.engine.runner.kv_cache.fill_(float("nan"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (40, 23, 5)]
    params = SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5, prompt_logprobs=5
    )
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        gen = out.outputs[0].token_ids
        assert len(gen) == 16
        ref = torch.log_softmax(hf_logits(hf, prompt + gen), dim=-1)
        # prefill: position i - 1 predicts prompt token i
        for i in range(1, len(prompt)):
            pos = out.prompt_logprobs[i]
            for token_id, lp in pos.items():
                assert abs(lp.logprob - ref[i - 1, token_id].item()) < BOUND, (family, "prompt", i)
        # decode: step s samples from the logits at position len(prompt) - 1 + s
        for s, pos in enumerate(out.outputs[0].logprobs):
            row = ref[len(prompt) - 1 + s]
            for token_id, lp in pos.items():
                assert abs(lp.logprob - row[token_id].item()) < BOUND, (family, "decode", s)
            # greedy took HF's argmax (up to ties)
            assert row[gen[s]].item() >= row.max().item() - BOUND
