"""The reference paged attention backend against a naive dense causal attention written out in full.

Random ragged batches: decodes, full prefills and chunks after a cached prefix; several head dims,
GQA, block sizes.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.attention import kv_cache_shape
from engine.attention.torch_ref import TorchAttentionBackend
from tiny_models import host_metadata

FP32_BOUND = 1e-5  # max abs difference allowed in float32


def naive_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q [Q, H, D] are the last Q positions of a context keys/values [S, Hkv, D]; dense math in
    float32."""
    num_q, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = keys.float().repeat_interleave(group, dim=1)  # [S, H, D]
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q.float(), k) * scale
    q_pos = torch.arange(seq_len - num_q, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    masked = k_pos > q_pos
    if window is not None:
        masked |= k_pos <= q_pos - window
    scores = scores.masked_fill(masked, float("-inf"))
    return torch.einsum("hqs,shd->qhd", torch.softmax(scores, dim=-1), v)


def run_case(
    seq_lens: list[int],
    query_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    window: int | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(backend output, naive output) for one random ragged batch; also checks the cache holds every
    token."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled, non-contiguous block ids
    tables, at = [], 0
    for n in blocks_per_seq:
        tables.append(perm[at : at + n])
        at += n
    cache = torch.zeros(
        kv_cache_shape(1, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype
    )[0]

    def slot(i: int, p: int) -> int:
        return tables[i][p // block_size] * block_size + p % block_size

    qs, ks, vs, slots, expected, starts = [], [], [], [], [], [0]
    scale = head_dim**-0.5
    for i, (s, n) in enumerate(zip(seq_lens, query_lens)):
        k_all = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)
        v_all = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)
        q = torch.randn(n, num_heads, head_dim, generator=gen).to(dtype)
        for p in range(s - n):  # the cached prefix, written by an earlier step
            cache[0].view(-1, num_kv_heads, head_dim)[slot(i, p)] = k_all[p]
            cache[1].view(-1, num_kv_heads, head_dim)[slot(i, p)] = v_all[p]
        qs.append(q)
        ks.append(k_all[s - n :])
        vs.append(v_all[s - n :])
        slots += [slot(i, p) for p in range(s - n, s)]
        expected.append(naive_attention(q, k_all, v_all, scale, window))
        starts.append(starts[-1] + n)

    meta = host_metadata(slots, starts, seq_lens, tables, block_size, device)
    cache = cache.to(device)
    out = TorchAttentionBackend().forward(
        torch.cat(qs).to(device),
        torch.cat(ks).to(device),
        torch.cat(vs).to(device),
        cache,
        meta,
        scale,
        sliding_window=window,
    )
    assert out.shape == (sum(query_lens), num_heads, head_dim) and out.dtype == dtype
    # After the step every context token's K/V is in the cache at its slot.
    flat_k = cache[0].view(-1, num_kv_heads, head_dim).cpu()
    for i, (s, n) in enumerate(zip(seq_lens, query_lens)):
        new = torch.tensor([slot(i, p) for p in range(s - n, s)], dtype=torch.int64)
        torch.testing.assert_close(flat_k[new], ks[i], rtol=0, atol=0)
    return out.float().cpu(), torch.cat(expected)


# Ragged batch: a decode, a full prefill, a chunk after a cached prefix, a 1-token prompt, a long
# decode.
SEQ_LENS = [9, 23, 37, 1, 50]
QUERY_LENS = [1, 23, 11, 1, 1]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_matches_naive_float32(head_dim: int, group: int, block_size: int) -> None:
    out, ref = run_case(
        SEQ_LENS, QUERY_LENS, 2, group, head_dim, block_size, seed=head_dim + group + block_size
    )
    assert (out - ref).abs().max().item() < FP32_BOUND


@pytest.mark.parametrize("seed", range(4))
def test_random_ragged_batches(seed: int) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    batch = int(torch.randint(1, 6, (1,), generator=gen))
    seq_lens = torch.randint(1, 70, (batch,), generator=gen).tolist()
    query_lens = [int(torch.randint(1, s + 1, (1,), generator=gen)) for s in seq_lens]
    out, ref = run_case(seq_lens, query_lens, 2, 2, 64, 4, seed=seed)
    assert (out - ref).abs().max().item() < FP32_BOUND


@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window(window: int) -> None:
    out, ref = run_case(SEQ_LENS, QUERY_LENS, 2, 2, 64, 4, window=window)
    assert (out - ref).abs().max().item() < FP32_BOUND


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype: torch.dtype) -> None:
    out, ref = run_case(SEQ_LENS, QUERY_LENS, 2, 4, 64, 4, dtype=dtype)
    assert (out - ref).abs().max().item() < (3e-2 if dtype == torch.bfloat16 else 5e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda(dtype: torch.dtype) -> None:
    out, ref = run_case(SEQ_LENS, QUERY_LENS, 2, 4, 128, 16, dtype=dtype, device="cuda")
    bound = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    assert (out - ref).abs().max().item() < bound
