"""FP8 (e4m3) GEMM kernels and their torch reference: y = (x quantized per token) @ (W quantized per
output channel)^T, scaled back, in x's dtype.

Weights: float8_e4m3fn [N, K] with fp32 scales [N] (one per output channel: amax / 448). Activations
are quantized dynamically, one fp32 scale per token (row), the same way. On CUDA:
- one row (batch-1 decode): a dot-free GEMV ("gemv": fp32 multiply-adds, one reduction at the
  end: engine/layers/row_gemv.py's kernel with no prologue), bf16 activations against the FP8
  weights. A skinny Triton kernel in the spirit of engine/layers/skinny_gemm.py (SKINNY_VARIANTS:
  the weights widened to x's dtype for a bf16 dot, "w8a16", or x quantized per token inside the
  kernel for an fp8 dot, "w8a8") served 2-16 rows until the unit-scale product below beat it
  there (bench/results/2026-11-28-h200-fp8-unit-scales/); the benchmarks still run it, and
  ONE_ROW_PATH "skinny" puts it on the one row. (Swapping the dot's operands, y^T = W x^T,
  measured no faster and was removed: bench/results/2026-11-26-h100-fp8/.)
- more rows: a Triton kernel quantizes the activations per token (or the norm or activation
  before the linear wrote them quantized: forward_quantized), then up to UNIT_SCALES_MAX_ROWS rows
  torch._scaled_mm with unit per-tensor scales into fp32 (cuBLAS) and one Triton kernel that
  applies the row and channel scales (and bias); above, torch._scaled_mm with row-wise scales
  (CUTLASS). At decode batches the per-tensor kernel reads the weights much closer to the byte
  floor than the row-wise one (bench/fp8_gemm.py).
Which path and tiles: bench/fp8_gemm.py (bench/results/2026-11-26-h100-fp8/), docs/engine.md.
On CPU fp8_linear_reference: the W8A8 numerics (the many-row paths') as torch._scaled_mm in fp32
(the CPU build runs it), so CI checks them; the one-row GEMV keeps x in bf16, so GPU batch-1
decode differs from it only by being closer to the unquantized product.
"""

from __future__ import annotations

import torch

from engine.layers.fused import fused_kernels_available
from engine.layers.row_gemv import PLAIN, default_config, row_gemv
from engine.pdl import launch_options, release

try:  # a CPU-only install may have no triton; the reference path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
MIN_AMAX = 1e-12  # an all-zero row still gets a finite scale
Fp8SkinnyConfig = tuple[int, int, int, int]  # (BLOCK_N, BLOCK_K, num_warps, num_stages)
# up to this many rows _scaled_mm per-tensor with unit scales + the scaling kernel, above it
# _scaled_mm row-wise (bench/fp8_gemm.py)
UNIT_SCALES_MAX_ROWS = 128
# cuda_path's paths that multiply rows quantized per token beforehand (forward_quantized takes them)
QUANTIZED_ROW_PATHS = ("scaled_mm_unit_scales", "scaled_mm_rowwise")
SKINNY_VARIANTS = ("w8a16", "w8a8")
SKINNY_VARIANT = "w8a16"  # the skinny kernel's variant when ONE_ROW_PATH is "skinny"
# One row (batch-1 decode): "gemv", "skinny" (SKINNY_VARIANT), or "scaled_mm" (its per-token scale
# is a per-tensor one: _scaled_mm's per-tensor kernel, then the channel scales in one multiply)
ONE_ROW_PATHS = ("gemv", "skinny", "scaled_mm")
ONE_ROW_PATH = "gemv"
_ONES: dict[torch.device, torch.Tensor] = {}
# (variant, N, K) -> tiles that replace the defaults (benchmarks install their sweep's best here)
TILE_OVERRIDES: dict[tuple[str, int, int], Fp8SkinnyConfig] = {}


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (float8_e4m3fn [..., K], fp32 scales [..., 1]): one scale per row, amax / 448,
    values x / scale rounded to nearest. Used for the weights (once) and for CPU activations."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of rows quantized by quantize_rows_reference (scale [..., 1] or [N])."""
    return q.float() * (scale if scale.dim() == q.dim() else scale.unsqueeze(-1))


if triton is not None:
    from engine.layers.fused import e4m3_scale, e4m3_values

    @triton.jit
    def _quantize_rows_kernel(
        x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr, PDL: tl.constexpr
    ):
        """Program r: row r's amax, its scale amax / 448, and the row as e4m3."""
        release(PDL)
        row = tl.program_id(0).to(tl.int64)
        rk = tl.arange(0, BLOCK_K)
        x_row = x_ptr + row * stride_xm
        peak = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_row + k0 + rk, mask=(k0 + rk) < K, other=0.0).to(tl.float32)
            peak = tl.maximum(peak, tl.abs(x))
        scale = e4m3_scale(tl.max(peak, axis=0))
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK_K):
            ok = (k0 + rk) < K
            x = tl.load(x_row + k0 + rk, mask=ok, other=0.0).to(tl.float32)
            q = e4m3_values(x, scale, q_ptr.dtype.element_ty)
            tl.store(q_ptr + row * stride_qm + k0 + rk, q, mask=ok)

    @triton.jit
    def _fp8_skinny_kernel(
        x_ptr,
        w_ptr,
        ws_ptr,
        b_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_ym,
        HAS_BIAS: tl.constexpr,
        QUANTIZE_X: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Program n: output columns [n * BLOCK_N, +BLOCK_N) of every row; the main loop walks the
        FP8 weight rows once. QUANTIZE_X: a first pass over x (few rows, from L2) finds each row's
        scale, the main loop quantizes x to e4m3 for an fp8 dot; else the weights are widened to
        x's dtype for the dot. Scales apply to the fp32 accumulator at the end."""
        release(PDL)
        pid_n = tl.program_id(0)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        rows_ok = rm < M
        rn_safe = tl.where(rn < N, rn, 0).to(tl.int64)  # out-of-range columns re-read row 0
        x_base = x_ptr + rm[:, None] * stride_xm + rk[None, :]
        if QUANTIZE_X:
            peak = tl.zeros([BLOCK_M], dtype=tl.float32)
            x_ptrs = x_base
            for k0 in range(0, K, BLOCK_K):
                x_mask = rows_ok[:, None] & ((k0 + rk) < K)[None, :]
                x = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
                peak = tl.maximum(peak, tl.max(tl.abs(x), axis=1))
                x_ptrs += BLOCK_K
            x_scale = tl.maximum(peak, 1e-12) / 448.0
        w_ptrs = w_ptr + rn_safe[:, None] * stride_wn + rk[None, :]
        x_ptrs = x_base
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
            if QUANTIZE_X:
                xq = tl.clamp(x.to(tl.float32) / x_scale[:, None], -448.0, 448.0)
                acc += tl.dot(xq.to(w_ptr.dtype.element_ty), tl.trans(w))
            else:
                acc += tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)))
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        acc = acc * tl.load(ws_ptr + rn_safe)[None, :]
        if QUANTIZE_X:
            acc = acc * x_scale[:, None]
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=rn < N, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=rows_ok[:, None] & (rn < N)[None, :])


if triton is not None:

    @triton.jit
    def _scale_product_kernel(
        acc_ptr, xs_ptr, ws_ptr, b_ptr, y_ptr, N, stride_acc, stride_y,
        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Program (m, j): y[m, cols] = acc[m, cols] * x_scale[m] * w_scale[cols] (+ bias), cols
        the j-th BLOCK_N columns; fp32 arithmetic, rounded once to y's dtype."""
        release(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = cols < N
        acc = tl.load(acc_ptr + row * stride_acc + cols, mask=ok, other=0.0)
        y = acc * tl.load(xs_ptr + row) * tl.load(ws_ptr + cols, mask=ok, other=0.0)
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, 1]); one Triton kernel on CUDA, the reference
    elsewhere."""
    if triton is None or not x.is_cuda:
        return quantize_rows_reference(x)
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block_k = min(triton.next_power_of_2(k), 4096)
        _quantize_rows_kernel[(m,)](
            x, q, scale, k, x.stride(0), q.stride(0), BLOCK_K=block_k, num_warps=4,
            **launch_options(),
        )  # fmt: skip
    return q, scale


def default_skinny_config(n: int, k: int, variant: str | None = None) -> Fp8SkinnyConfig:
    """Tiles per shape and variant ("gemv" too), the fastest of bench/fp8_gemm.py's sweep at one
    row on Llama-3.1-8B's shapes (bench/results/2026-11-26-h100-fp8/fp8_gemm.json)."""
    variant = variant or SKINNY_VARIANT
    if (variant, n, k) in TILE_OVERRIDES:
        return TILE_OVERRIDES[(variant, n, k)]
    if variant == "gemv":  # the one-row kernel's own tiles for e4m3 without a prologue
        return default_config(PLAIN, FP8, n, k)
    if k >= 8192 or n == k:  # down_proj, o_proj
        return (32, 1024, 4, 3)
    return (32, 512, 4, 3)  # qkv, gate_up


def fp8_skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    variant: str | None = None,
    config: Fp8SkinnyConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16/fp16, M small) @ dequant(weight [N, K] e4m3, weight_scale [N])^T (+ bias)
    -> [M, N] in x's dtype. variant: one of SKINNY_VARIANTS or "gemv" (one row); default
    SKINNY_VARIANT, or "gemv" for one row when ONE_ROW_PATH says so. config: tiles (the benchmark
    sweeps them)."""
    n, k = weight.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    if variant is None:
        variant = "gemv" if m == 1 and ONE_ROW_PATH == "gemv" else SKINNY_VARIANT
    tiles = config or default_skinny_config(n, k, variant)
    if variant == "gemv":  # the one-row kernel of bf16 decode, without a prologue, scaled per row
        if m != 1:
            raise ValueError(f"fp8 gemv: one row, got {m}")
        return row_gemv(x, weight, weight_scale, bias, config=tiles)[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps, num_stages = tiles
    block_k = min(block_k, max(32, triton.next_power_of_2(k)))
    b = bias if bias is not None else weight_scale
    if variant not in SKINNY_VARIANTS:
        raise ValueError(f"fp8 skinny variant {variant!r}: one of {SKINNY_VARIANTS} or 'gemv'")
    _fp8_skinny_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        weight_scale,
        b,
        y,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        QUANTIZE_X=variant == "w8a8",
        BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch_options(),
    )
    return y


def scaled_mm_rowwise(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """torch._scaled_mm with per-token x scales [M, 1] and per-channel weight scales [N]; CUDA's
    row-wise kernels write bf16, so another dtype is cast after."""
    mm_dtype = torch.bfloat16 if xq.is_cuda else torch.float32
    y = torch._scaled_mm(
        xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), out_dtype=mm_dtype
    )
    return y if y.dtype == out_dtype else y.to(out_dtype)


def scaled_mm_one_row(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """One row: its per-token scale is a per-tensor scale, so _scaled_mm's per-tensor kernel
    serves it (weight scale 1), then the per-channel scales multiply the bf16 result."""
    xq, x_scale = quantize_per_token(x)
    one = _unit_scale(x.device)
    y = torch._scaled_mm(
        xq, weight.t(), scale_a=x_scale.view(()), scale_b=one, out_dtype=torch.bfloat16
    )
    return y.mul_(weight_scale)


def _unit_scale(device: torch.device) -> torch.Tensor:
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones((), dtype=torch.float32, device=device)
    return one


def scaled_mm_unit_scales(
    q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(q * x_scale) @ (weight * weight_scale[:, None])^T (+ bias) on CUDA: the e4m3 product
    through _scaled_mm's per-tensor kernel with unit scales, written in fp32, then one kernel
    scales it per row and channel, adds the bias and rounds to out_dtype (the numbers of the
    row-wise kernel, whose epilogue does the same in fp32)."""
    one = _unit_scale(q.device)
    acc = torch._scaled_mm(q, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    m, n = acc.shape
    y = torch.empty((m, n), dtype=out_dtype, device=q.device)
    if m:
        block_n = min(triton.next_power_of_2(n), 1024)
        _scale_product_kernel[(m, triton.cdiv(n, block_n))](
            acc, x_scale, weight_scale, bias if bias is not None else weight_scale, y, n,
            acc.stride(0), y.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n, num_warps=4,
            **launch_options(),
        )  # fmt: skip
    return y


def quantized_rows_gemm(
    q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Rows already quantized per token (q e4m3 [M, K], x_scale fp32 [M, 1]) times the weight,
    scaled, plus bias, in out_dtype: on CUDA up to UNIT_SCALES_MAX_ROWS rows
    scaled_mm_unit_scales, else (and on CPU) _scaled_mm row-wise."""
    if fused_kernels_available(q) and quantized_rows_path(q.shape[0]) == "scaled_mm_unit_scales":
        return scaled_mm_unit_scales(q, x_scale, weight, weight_scale, bias, out_dtype)
    y = scaled_mm_rowwise(q, x_scale, weight, weight_scale, out_dtype)
    return y + bias if bias is not None else y


def scaled_mm_fits(weight: torch.Tensor) -> bool:
    """torch._scaled_mm's shape rule on CUDA: both dimensions of the weight multiples of 16."""
    n, k = weight.shape
    return n % 16 == 0 and k % 16 == 0


def quantized_rows_path(rows: int) -> str:
    """Which of QUANTIZED_ROW_PATHS multiplies `rows` rows quantized per token on CUDA."""
    return "scaled_mm_unit_scales" if 0 < rows <= UNIT_SCALES_MAX_ROWS else "scaled_mm_rowwise"


def cuda_path(rows: int, dtype: torch.dtype) -> str:
    """Which kernel fp8_linear runs for `rows` rows of `dtype` on CUDA: for one bf16/fp16 row
    "gemv", a skinny variant or "scaled_mm_one_row" (ONE_ROW_PATH), else quantized_rows_path's
    (after the per-token quantizer)."""
    if rows == 1 and dtype in (torch.bfloat16, torch.float16):
        if ONE_ROW_PATH == "scaled_mm" and dtype == torch.bfloat16:
            return "scaled_mm_one_row"
        return "gemv" if ONE_ROW_PATH == "gemv" else SKINNY_VARIANT
    return quantized_rows_path(rows)


def quantizes_activations(path: str) -> bool:
    """Whether a cuda_path multiplies per-token-quantized activations (W8A8) or keeps x (W8A16)."""
    return not (path == "gemv" or path.endswith("w8a16"))


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ dequant(weight, weight_scale)^T (+ bias) -> [..., N] in x's dtype: the skinny
    kernel for decode rows, per-token quantization + _scaled_mm for more, the reference on CPU."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    path = cuda_path(x2.shape[0], x2.dtype) if fused_kernels_available(x) else "reference"
    if x2.shape[0] == 0 or (path.startswith("scaled_mm") and not scaled_mm_fits(weight)):
        path = "reference"
    if path == "reference":
        y = fp8_linear_reference(x2, weight, weight_scale, bias)
    elif path == "scaled_mm_one_row":
        y = scaled_mm_one_row(x2, weight, weight_scale)
        if bias is not None:
            y = y + bias
    elif path in QUANTIZED_ROW_PATHS:
        xq, x_scale = quantize_per_token(x2)
        y = quantized_rows_gemm(xq, x_scale, weight, weight_scale, bias, x.dtype)
    else:
        y = fp8_skinny_gemm(x2, weight, weight_scale, bias, variant=path)
    return y.view(*x.shape[:-1], n)


def fp8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same W8A8 numerics in torch: per-token quantization (quantize_rows_reference), the fp8
    product accumulated in fp32 (torch._scaled_mm on CPU, dequantized fp32 matmul elsewhere), scaled
    per row and per channel, bias added in fp32, rounded to x's dtype."""
    if x.shape[0] == 0:
        return x.new_empty((0, weight.shape[0]))
    xq, x_scale = quantize_rows_reference(x)
    if x.is_cuda:
        y = (xq.float() * x_scale) @ dequantize_rows(weight, weight_scale).t()
    else:  # unit scales, then per row and channel: torch 2.11's CPU _scaled_mm is per-tensor only
        one = torch.ones((), dtype=torch.float32)
        y = torch._scaled_mm(xq, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        y = y * x_scale * weight_scale.view(1, -1).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
