"""Skinny GEMM in Triton for decode (few rows, M <= 16): y = x @ W^T (+ b), reading each weight once
at bandwidth.

cuBLAS picks split-K kernels plus a reduce launch for these shapes; this kernel tiles N finely
instead, and writes the lm_head's fp32 logits in the same pass (tiles per shape from
bench/gemm_micro.py: bench/results/2026-11-22-h100-gemm-micro.json).
"""

from __future__ import annotations

import torch

from engine.pdl import launch_options, release

try:  # a CPU-only install may have no triton; the torch layers never need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None

MAX_ROWS = 16  # above this cuBLAS's tensor-core tiles win; the skinny kernel is for decode batches
SkinnyConfig = tuple[int, int, int, int]  # (BLOCK_N, BLOCK_K, num_warps, num_stages)


if triton is not None:

    @triton.jit
    def _skinny_gemm_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ym,
        HAS_BIAS: tl.constexpr,
        ROUND: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Program n: output columns [n * BLOCK_N, +BLOCK_N) of every row; the loop walks K once.

        ROUND: round the fp32 result to x's dtype before storing into a wider y (bf16 logits in an
        fp32 buffer).
        """
        release(PDL)
        pid_n = tl.program_id(0)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        rows_ok = rm < M
        # out-of-range columns re-read row 0 (stores are masked)
        rn_safe = tl.where(rn < N, rn, 0).to(tl.int64)
        w_ptrs = w_ptr + rn_safe[:, None] * stride_wn + rk[None, :]
        x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x_mask = rows_ok[:, None]
            else:
                k_ok = (k0 + rk) < K
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                x_mask = rows_ok[:, None] & k_ok[None, :]
            x = tl.load(x_ptrs, mask=x_mask, other=0.0)
            acc += tl.dot(x, tl.trans(w))
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=rn < N, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        if ROUND:
            acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=rows_ok[:, None] & (rn < N)[None, :])


def skinny_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when the skinny kernel serves x @ weight^T: CUDA, bf16/fp16, at most MAX_ROWS rows,
    weight rows dense."""
    if (
        triton is None
        or not x.is_cuda
        or x.dtype not in (torch.bfloat16, torch.float16)
        or weight.dtype != x.dtype
    ):
        return False
    if x.shape[-1] != weight.shape[1] or weight.stride(1) != 1 or x.numel() == 0:
        return False
    return x.numel() // weight.shape[1] <= MAX_ROWS


def default_config(n: int, k: int) -> SkinnyConfig:
    """Tiles per shape, the fastest of a sweep at 1 row, weights read from HBM (Llama-3.1-8B's
    shapes; bench/results/2026-11-22-h100-gemm-micro.json)."""
    if n >= 16384:  # gate_up, lm_head
        return (32, 512, 4, 4)
    if n >= 6144:  # fused qkv
        return (64, 256, 4, 3)
    if k >= 8192:  # down_proj
        return (32, 512, 4, 3)
    return (32, 256, 4, 4)  # o_proj


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) -> [..., N] in x's dtype.

    `out` (2-D [rows, N], e.g. an fp32 logits buffer) receives the result rounded to x's dtype
    first, as F.linear(...).float() would give. `config` overrides the tiles (the benchmark sweeps
    them).
    """
    n, k = weight.shape
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps, num_stages = config or default_config(n, k)
    block_k = min(block_k, triton.next_power_of_2(k))
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x2,
        weight,
        bias if bias is not None else weight,
        y,
        m,
        n,
        k,
        x2.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        ROUND=y.dtype != x.dtype,
        BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch_options(),
    )
    if out is not None:
        return out
    return y.view(*x.shape[:-1], n)
