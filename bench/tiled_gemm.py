"""A candidate measured against cuBLAS by bench.gemm_micro: a tiled Triton GEMM for M ~ 64-256,
optionally split-K.

Programs sharing a weight tile run side by side, split-K partials add atomically in fp32. On the
H100 cuBLAS won at M=256 for every Llama-3.1-8B projection
(bench/results/2026-11-22-h100-gemm-micro.json), so the engine does not use it.
"""

from __future__ import annotations

import torch

try:  # a CPU-only install may have no triton; the torch layers never need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None

# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)
TiledConfig = tuple[int, int, int, int, int, int]


if triton is not None:

    @triton.jit
    def _tiled_gemm_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ym,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
    ):
        """Program p: split p % SPLIT_K, row tile (p // SPLIT_K) % num_m, column tile the rest (row
        tiles and splits of one weight tile run side by side, so the weight comes from HBM once).
        SPLIT_K > 1 adds into fp32 y."""
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        split = pid % SPLIT_K
        pid_m = (pid // SPLIT_K) % num_m
        pid_n = pid // (SPLIT_K * num_m)
        k_len = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = split * k_len
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        rm_safe = tl.where(rm < M, rm, 0).to(tl.int64)
        rn_safe = tl.where(rn < N, rn, 0).to(tl.int64)
        x_ptrs = x_ptr + rm_safe[:, None] * stride_xm + (k_lo + rk)[None, :]
        w_ptrs = w_ptr + rn_safe[:, None] * stride_wn + (k_lo + rk)[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, tl.minimum(k_lo + k_len, K), BLOCK_K):
            k_ok = (k0 + rk) < K
            x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w))
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(y_ptrs, acc, mask=mask, sem="relaxed")


def tiled_gemm(x: torch.Tensor, weight: torch.Tensor, config: TiledConfig) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype (through an fp32 buffer when the config
    splits K)."""
    block_m, block_n, block_k, split_k, num_warps, num_stages = config
    m, k = x.shape
    n = weight.shape[0]
    if split_k == 1:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        y = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n) * split_k,)
    _tiled_gemm_kernel[grid](
        x,
        weight,
        y,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y if split_k == 1 else y.to(x.dtype)
