"""engine/structured.py's bitmask on the GPU: the same masked logits as on the CPU, at a
Llama-3-sized vocabulary and batch 64 (imports only torch and the engine, as the GPU machine has
them)."""

from __future__ import annotations

import pytest
import torch

from engine.structured import apply_token_bitmask


@pytest.mark.gpu
def test_apply_token_bitmask_on_the_gpu_matches_the_cpu():
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (64, 4008), dtype=torch.int32, generator=gen)
    bitmask[3] = -1
    for vocab in (128256, 128000, 128300):  # the mask's width, a narrower and a wider logits row
        logits = torch.randn(64, vocab, generator=gen)
        expected = apply_token_bitmask(logits.clone(), bitmask)
        got = apply_token_bitmask(logits.cuda(), bitmask.cuda())
        assert torch.equal(got.cpu(), expected)
        assert torch.isfinite(got[3, :128256]).all()
