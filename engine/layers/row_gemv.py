"""Batch-1 decode's linears with the elementwise op before them folded in: one kernel computes
linear(rms_norm(x + residual)) (attention's qkv, the MLP's gate_up; Llama's norm or Gemma's (1 + w))
or linear(act(gate) * up) (the MLP's down; SiLU or Gemma's tanh GELU), so the norm and the
activation cost no launch of their own. The activation can instead close gate_up's kernel (the
epilogue: each program holds gate and up rows in pairs), so that down reads act(gate) * up, half
as wide, with no prologue: the MLP's path when GATED (one_row_gated).

The norm can instead be split over the two linears around it (NORM_AFTER, at Llama-style
layers): the kernel of the linear before it (o_proj; down, for the next layer's norm) adds the
residual to its output rows and writes s = y + residual, w * s and its programs' sums of s^2
(EPILOGUE NORM), and the kernel of the linear after it reads w * s as its row and divides by the
rms at the end (PROLOGUE NORMED): a NormedRow passed between them (linear_add_norm, norm_linear,
one_row_gated). Every program then reads one row, not the row, the residual and the norm weight,
and FP8 weights lose the norm's own kernel (bench/results/2026-11-28-h100-norm-after/).

One row of input: each program reads the whole row (from L2) beside its BLOCK_N rows of the
weight, so the prologue is recomputed per program and never written out. The norm's 1/rms is a
scalar that factors out of the dot product: W (g * x / rms) = (W (g * x)) / rms, the sum of squares
gathered in the same pass over K and applied once at the end. With a residual the first program
also writes x + residual, the stream the next layer adds to.

Weights in the activation dtype (bf16/fp16), or float8_e4m3fn with one fp32 scale per output row:
without a prologue this is the FP8 linears' one-row GEMV (engine/quant/fp8_kernels.py, "gemv").
Those do not take the norm and SiLU prologues unless FUSE_FP8: fused, FP8 decode measured slower
than its GEMV after a norm kernel (bench/results/2026-11-27-h100-row-gemv/, and again with
programmatic dependent launch: bench/results/2026-11-27-h100-pdl/), since every program reads the
residual, the row and the norm weight beside only half the bytes of weight a bf16 program reads.

Launch (engine.pdl): each program requests its first weight tile, then waits for the kernel before;
the kernel launches early only without a prologue (its kernel before is then small: attention, the
norm or SiLU before an FP8 linear) or with NORMED (PDL_NORMED; measured faster than without).

Numerics: fp32 throughout, rounded where torch rounds the sum x + residual and the activation; the
normed input is not rounded to the activation dtype before the product (split, w * s is: the row
the second kernel reads), so results differ from the unfused layers by bf16 rounding.

Who takes it: norm_linear, one_row_gated, act_linear, linear_add_norm and one_row_linear below
(the decoder's only callers; the last two, o_proj's and down's, have no prologue), on CUDA, for one
row, an RMSNorm (Llama's or Gemma's) and a linear whose one_row_operands() gives (weight, scale,
bias) with its weight in the activation dtype, or FP8 with its scales when FUSE_FP8 or without a
prologue (row-parallel linears give none: they all-reduce after). FUSE turns it off
(bench/fp8_decode.py --prologues and --fp8-prologues measure both).
Tiles: bench/row_gemv.py's sweep.

More rows, FP8 linears quantize their input per token before _scaled_mm; norm_linear and
act_linear then have the norm or the gate activation write its rows quantized instead
(engine.layers.fused: rms_norm_fp8, gate_and_mul_fp8), so the quantizer is not a launch of its own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.layers.activation import gate_and_mul
from engine.layers.fused import (
    GATE_ACTIVATIONS,
    fused_kernels_available,
    gate_and_mul_fp8,
    rms_norm_fp8,
)
from engine.layers.norm import OffsetRMSNorm, RMSNorm
from engine.pdl import launch_options, release

try:  # a CPU-only install may have no triton; the unfused layers never need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None


class NormedRow(NamedTuple):
    """norm(x + residual) of one decode row, begun by the kernel of the linear that made x
    (linear_add_norm) and finished by the kernel of the linear that reads it (norm_linear,
    one_row_gated): `scaled` is w * (x + residual) (Gemma's norm: (1 + w) * ...) in the activation
    dtype, `squares` each of the first kernel's programs' sum of (x + residual)^2 in fp32, `summed`
    x + residual (the residual stream after the add); the reader divides its sums by
    sqrt(sum(squares) / K + eps). So the norm costs no launch of its own."""

    scaled: torch.Tensor
    squares: torch.Tensor
    summed: torch.Tensor
    norm: RMSNorm

    def finish(self) -> torch.Tensor:
        """norm(x + residual) itself, for a reader with no kernel that takes the row unfinished."""
        rms = torch.sqrt(self.squares.sum() / self.scaled.shape[-1] + self.norm.eps)
        return (self.scaled.float() / rms).to(self.scaled.dtype)


FUSE = True  # the fused one-row path on (benchmarks turn it off to compare)
FUSE_FP8 = False  # FP8 weights take the prologues too (benchmarks compare)
PDL_PROLOGUES = False  # the kernels with a prologue launch early too (benchmarks compare)
PDL_NORMED = True  # the kernels reading a NormedRow launch early (benchmarks compare)
# the norm or gate activation before an FP8 linear that quantizes its rows per token writes them
# quantized (_quantized_rows; benchmarks turn it off to compare)
FUSE_QUANTIZE = True
GATED = True  # gate_up's kernel applies act(gate) * up (one_row_gated; benchmarks turn it off)
# the next norm begun in the kernel of the linear before it (linear_add_norm; benchmarks turn it
# off)
NORM_AFTER = True
# the prologue applied to x before the product (GELU_MUL: the tanh form, Gemma's; NORMED: x is a
# NormedRow's scaled row, its 1/rms applied at the end); as an epilogue, NORM begins the next norm
PLAIN, NORM, SILU_MUL, GELU_MUL, NORMED = 0, 1, 2, 3, 4
_ACT_PROLOGUES = {"silu": SILU_MUL, "gelu_pytorch_tanh": GELU_MUL}
_ACT_NAMES = {code: name for name, code in _ACT_PROLOGUES.items()}
RowGemvConfig = tuple[int, int, int, int]  # (BLOCK_N, BLOCK_K, num_warps, num_stages)
# (prologue, weight dtype name, N, K) -> tiles replacing the defaults (a benchmark's sweep)
TILE_OVERRIDES: dict[tuple[int, str, int, int], RowGemvConfig] = {}


if triton is not None:
    from engine.layers.fused import gate_activation

    @triton.jit
    def begin_norm_rows(y, residual, g, ok):
        """The next RMSNorm begun on output elements y (EPILOGUE NORM here, the experts' down kernel
        in engine.layers.fused_moe_decode): (s = y + residual, rounded to y's dtype as torch's sum
        is; the sum of s^2 over the elements `ok`; g * s in y's dtype). g: the norm's weight in
        float32, (1 + w) for Gemma's."""
        summed = (y.to(tl.float32) + residual.to(tl.float32)).to(y.dtype)
        sf = tl.where(ok, summed.to(tl.float32), 0.0)
        return summed, tl.sum(sf * sf, axis=0), (sf * g).to(y.dtype)

    @triton.jit
    def _accumulate(
        acc, squares, w, x_ptr, res_ptr, g_ptr, res_out_ptr, k, K, pid,
        PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr,
        OFFSET: tl.constexpr,
    ):  # fmt: skip
        """One BLOCK_K step: acc += w * prologue(x[k]) (and the norm's sum of squares)."""
        k_ok = k < K
        if EVEN_K:
            x = tl.load(x_ptr + k)
        else:
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
        if PROLOGUE == 1:  # NORM
            if HAS_RESIDUAL:
                res = tl.load(res_ptr + k, mask=k_ok, other=0.0)
                # rounded to the activation dtype, as torch's x + residual is
                x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
                tl.store(res_out_ptr + k, x, mask=k_ok & (pid == 0))
            xf = x.to(tl.float32)
            squares += xf * xf
            g = tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            if OFFSET:  # Gemma's norm scales by (1 + w)
                g = 1.0 + g
            xf = xf * g
        elif PROLOGUE == 2 or PROLOGUE == 3:  # SILU_MUL, GELU_MUL
            gate = x.to(tl.float32)
            up = tl.load(x_ptr + K + k, mask=k_ok, other=0.0).to(tl.float32)
            # the activation rounded to the activation dtype before the product, as torch's
            # act(gate) * up
            if PROLOGUE == 2:
                act = gate_activation(gate, 0)  # engine.layers.fused.GATE_ACTIVATIONS' SiLU
            else:
                act = gate_activation(gate, 1)  # and its tanh GELU
            act = act.to(x_ptr.dtype.element_ty).to(tl.float32)
            xf = (act * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        else:
            xf = x.to(tl.float32)
        acc += w.to(tl.float32) * xf[None, :]
        return acc, squares

    @triton.jit
    def _row_gemv_kernel(
        x_ptr,
        res_ptr,
        g_ptr,
        w_ptr,
        ws_ptr,
        b_ptr,
        y_ptr,
        res_out_ptr,
        sq_in_ptr,
        sq_out_ptr,
        N,
        K,
        stride_wn,
        eps,
        n_sq_in,
        PROLOGUE: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        OFFSET: tl.constexpr,
        EPILOGUE: tl.constexpr,
        SQ_IN: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Program n: y[n * BLOCK_N : +BLOCK_N] = W[rows] @ prologue(x), fp32 multiply-adds into a
        [BLOCK_N, BLOCK_K] accumulator reduced once at the end. SILU_MUL, GELU_MUL: x holds
        [gate | up], each K long. OFFSET: NORM scales by (1 + w). The first weight tile is
        requested before the wait for the kernel before (no kernel writes the weights) and used by
        a first step outside the loop.

        EPILOGUE SILU_MUL / GELU_MUL: W is [gate; up], 2N rows, and y = act(gate) * up, N wide;
        the program's BLOCK_N rows alternate gate row i and up row N + i, so that its sums split
        into the pairs the activation takes.

        EPILOGUE NORM begins the next norm: s = y + residual goes to res_out, g * s (OFFSET:
        (1 + g) * s) to y, and the program's sum of s^2 to sq_out[pid]. PROLOGUE NORMED reads such
        a row as x and divides by sqrt(sum(sq_in[:n_sq_in]) / K + eps) at the end."""
        pid = tl.program_id(0)
        if EPILOGUE == 0 or EPILOGUE == 1:
            rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            row_ok = rn < N
            rows = rn
        else:
            local = tl.arange(0, BLOCK_N)
            rn = pid * (BLOCK_N // 2) + local // 2  # the gate row (and output) each row feeds
            row_ok = rn < N
            rows = rn + (local % 2) * N
        rk = tl.arange(0, BLOCK_K)
        rn_safe = tl.where(row_ok, rows, 0).to(tl.int64)  # out-of-range rows re-read row 0
        w_ptrs = w_ptr + rn_safe[:, None] * stride_wn + rk[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=(rk < K)[None, :], other=0.0)
        if EPILOGUE == 1:  # the norm weight's rows, before the wait (no kernel writes them)
            g_rows = tl.load(g_ptr + rn_safe).to(tl.float32)
            if OFFSET:
                g_rows = 1.0 + g_rows
        release(PDL)
        if PROLOGUE == 4:  # requested now, used after the loop
            sq_offs = tl.arange(0, SQ_IN)
            sq_in = tl.load(sq_in_ptr + sq_offs, mask=sq_offs < n_sq_in, other=0.0)
        if EPILOGUE == 1:
            res_rows = tl.load(res_ptr + rn_safe)
        acc, squares = _accumulate(
            acc, squares, w, x_ptr, res_ptr, g_ptr, res_out_ptr, rk, K, pid,
            PROLOGUE, HAS_RESIDUAL, EVEN_K, OFFSET,
        )  # fmt: skip
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w_ptrs += BLOCK_K
            if EVEN_K:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=((k0 + rk) < K)[None, :], other=0.0)
            acc, squares = _accumulate(
                acc, squares, w, x_ptr, res_ptr, g_ptr, res_out_ptr, k0 + rk, K, pid,
                PROLOGUE, HAS_RESIDUAL, EVEN_K, OFFSET,
            )  # fmt: skip
        y = tl.sum(acc, axis=1)
        if PROLOGUE == 1:
            y = y / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
        elif PROLOGUE == 4:
            y = y / tl.sqrt(tl.sum(sq_in, axis=0) / K + eps)
        if HAS_SCALE:
            y = y * tl.load(ws_ptr + rn_safe)
        if HAS_BIAS:
            y = y + tl.load(b_ptr + rn_safe, mask=row_ok, other=0.0).to(tl.float32)
        y = y.to(y_ptr.dtype.element_ty)  # the projection's output, rounded as torch's linear
        if EPILOGUE == 0:
            tl.store(y_ptr + rn, y, mask=row_ok)
        elif EPILOGUE == 1:
            summed, squares_out, scaled = begin_norm_rows(y, res_rows, g_rows, row_ok)
            tl.store(res_out_ptr + rn, summed, mask=row_ok)
            tl.store(sq_out_ptr + pid, squares_out)
            tl.store(y_ptr + rn, scaled, mask=row_ok)
        else:
            gate, up = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
            # act(gate) rounded to the activation dtype before the product, as torch's
            # act(gate) * up (engine.layers.fused's kernel)
            act = gate_activation(gate.to(tl.float32), EPILOGUE - 2)
            act = act.to(y_ptr.dtype.element_ty).to(tl.float32)
            out = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            gated = (act * up.to(tl.float32)).to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + out, gated, mask=out < N)


def default_config(prologue: int, weight_dtype: torch.dtype, n: int, k: int) -> RowGemvConfig:
    """Tiles per shape and weight width: the fastest of bench/row_gemv.py's sweep at Llama-3.1-8B's
    shapes on an H100 (bench/results/2026-11-27-h100-row-gemv/row_gemv.json), and at
    Qwen3-30B-A3B's (--config qwen3-30b-a3b.json, bench/results/2026-11-27-h100-moe-batch1/)."""
    name = str(weight_dtype).removeprefix("torch.")
    # the same loads, the same tiles
    prologue = {GELU_MUL: SILU_MUL, NORMED: PLAIN}.get(prologue, prologue)
    if (prologue, name, n, k) in TILE_OVERRIDES:
        return TILE_OVERRIDES[(prologue, name, n, k)]
    if weight_dtype.itemsize == 1 and prologue == PLAIN:
        # e4m3 without a prologue: the FP8 linears' one-row GEMV (engine.quant.fp8_kernels) and
        # FP8 gate_up closed by its activation (one_row_gated), bench/fp8_gemm.py's sweep
        if n >= 16384:  # gate_up
            return (16, 256, 4, 2)
        return (16, 512, 8, 3) if n >= 6144 else (8, 1024, 4, 2)  # qkv; o_proj, down
    if weight_dtype.itemsize == 1:  # e4m3 with a prologue (bench/row_gemv.py only)
        if n >= 16384:
            return (8, 1024, 4, 2)
        return (8, 512, 4, 2) if n >= 6144 else (8, 1024, 4, 3)
    if n <= 256:  # a router: the whole row in one step (Qwen3-30B-A3B's 128 x 2048)
        return (4, 2048, 4, 3)
    if n >= 16384:  # gate_up
        return (4, 512, 4, 3)
    if n >= 6144:  # qkv
        return (16, 512, 4, 3)
    if n >= 4096 and k <= 2048:  # a narrow model's qkv (Qwen3-30B-A3B's 5120 x 2048)
        return (8, 512, 4, 2)
    return (4, 512, 4, 2)  # down_proj


def row_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    prologue: int = PLAIN,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    config: RowGemvConfig | None = None,
    offset: bool = False,
    epilogue: int = PLAIN,
    squares: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [1, K] (SILU_MUL, GELU_MUL: [1, 2K]) -> (y [1, N] in x's dtype, x + residual or None).

    weight [N, K] in x's dtype, or e4m3 with weight_scale [N] fp32; NORM: norm_weight [K], eps, an
    optional residual [1, K], and offset for Gemma's (1 + w); SILU_MUL, GELU_MUL: x is
    [gate | up]; NORMED: x is a NormedRow's scaled row and `squares` its sums of squares (eps the
    norm's). epilogue SILU_MUL, GELU_MUL: weight is [gate; up] and y = act(gate) * up,
    [1, N / 2] (epilogue NORM: row_gemv_norm_after). config overrides the tiles."""
    y, summed, _ = _launch(
        x, weight, weight_scale, bias, prologue, norm_weight, eps, residual, config, offset,
        epilogue, squares,
    )  # fmt: skip
    return y, summed


def row_gemv_norm_after(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor,
    residual: torch.Tensor,
    offset: bool = False,
    config: RowGemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [1, K] -> s = W x + residual [1, N] and the next norm begun on it: (norm_weight * s (Gemma:
    (1 + w) * s) [1, N] in x's dtype, s, each program's sum of s^2 [programs] fp32)."""
    return _launch(
        x, weight, weight_scale, bias, PLAIN, norm_weight, 0.0, residual, config, offset, NORM,
        None,
    )  # fmt: skip


def _launch(
    x, weight, weight_scale, bias, prologue, norm_weight, eps, residual, config, offset, epilogue,
    squares,
):  # fmt: skip
    n, k = weight.shape
    x = x.contiguous()
    block_n, block_k, num_warps, num_stages = config or default_config(prologue, weight.dtype, n, k)
    block_k = min(block_k, max(32, triton.next_power_of_2(k)))
    if epilogue in (SILU_MUL, GELU_MUL):  # gate row i and up row n/2 + i alternate: pairs
        n, block_n = n // 2, max(2, block_n - block_n % 2)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    rows_per_program = block_n // 2 if epilogue in (SILU_MUL, GELU_MUL) else block_n
    grid = triton.cdiv(n, rows_per_program)
    summed = None
    if epilogue == NORM:
        summed = torch.empty_like(y)
    elif residual is not None:
        summed = torch.empty_like(x)
    squares_out = (
        torch.empty(grid, dtype=torch.float32, device=x.device) if epilogue == NORM else None
    )
    n_squares = squares.numel() if squares is not None else 0
    _row_gemv_kernel[(grid,)](
        x,
        residual.contiguous() if residual is not None else x,
        norm_weight if norm_weight is not None else x,
        weight,
        weight_scale if weight_scale is not None else x,
        bias if bias is not None else x,
        y,
        summed if summed is not None else y,
        squares if squares is not None else y,
        squares_out if squares_out is not None else y,
        n,
        k,
        weight.stride(0),
        eps,
        n_squares,
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        HAS_SCALE=weight_scale is not None,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        OFFSET=offset,
        EPILOGUE=epilogue,
        SQ_IN=max(16, triton.next_power_of_2(n_squares)),
        num_warps=num_warps,
        num_stages=num_stages,
        # engine.pdl: only without a prologue (the module docstring); with one, the kernel before
        # is often another GEMV, and launched early this one measured slower
        **launch_options(
            wanted=prologue == PLAIN or (prologue == NORMED and PDL_NORMED) or PDL_PROLOGUES
        ),
    )
    return y, summed, squares_out


def row_gemv_applies(x: torch.Tensor) -> bool:
    """True when x is one bf16/fp16 row on CUDA and the fused path is on (the kernel set's trace
    sees meta tensors as CUDA here: warmup.kernel_set)."""
    return (
        FUSE
        and triton is not None
        and x.is_cuda
        and x.dim() == 2
        and x.shape[0] == 1
        and x.dtype in (torch.bfloat16, torch.float16)
    )


def _operands(linear, x: torch.Tensor, k: int, prologue: bool = True):
    """The linear's (weight, scale, bias) when the one-row kernel can serve it for x (with a
    prologue, or without: FP8 weights then too), else None."""
    if not row_gemv_applies(x):
        return None
    get = getattr(linear, "one_row_operands", None)
    operands = get() if get is not None else None
    if operands is None:
        return None
    weight, scale, _ = operands
    widths_match = weight.dtype == x.dtype or (scale is not None and (FUSE_FP8 or not prologue))
    if not widths_match or weight.shape[1] != k or weight.stride(1) != 1:
        return None
    return operands


def _quantized_rows(linear, x: torch.Tensor, k: int) -> bool:
    """Whether the op before `linear` should hand it x's rows quantized per token: an FP8 linear
    that would quantize them itself (takes_quantized_rows: its many-row _scaled_mm path), 2-D
    rows of width k on CUDA, FUSE_QUANTIZE on. The norm or activation kernel then writes the
    e4m3 rows and their scales in place of its own output: one launch fewer, the same numbers."""
    takes = getattr(linear, "takes_quantized_rows", None)
    return (
        FUSE_QUANTIZE
        and takes is not None
        and x.dim() == 2
        and fused_kernels_available(x)
        and takes(x.shape[0], x.dtype)
        and getattr(linear, "in_features", k) == k
    )


def _kernel_norm(norm) -> bool:
    """Whether the kernels compute `norm` themselves: Llama's RMSNorm or Gemma's (1 + w) one,
    exactly (a subclass may change what it computes)."""
    return type(norm) in (RMSNorm, OffsetRMSNorm)


def one_row_norm_linear(norm, linear, x: torch.Tensor, residual: torch.Tensor | None):
    """(linear(norm(x + residual)), x + residual) in one kernel, or None where it does not apply
    (more than one row, not CUDA, another norm or weight type): norm_linear's fused case."""
    operands = _operands(linear, x, x.shape[-1]) if _kernel_norm(norm) else None
    if operands is None:
        return None
    weight, scale, bias = operands
    offset = isinstance(norm, OffsetRMSNorm)
    y, summed = row_gemv(
        x, weight, scale, bias, NORM, norm.weight, norm.eps, residual=residual, offset=offset
    )
    return y, (summed if residual is not None else x)


def norm_linear(norm, linear, x: torch.Tensor, residual: torch.Tensor | None):
    """(linear(norm(x + residual)), x + residual); without a residual (linear(norm(x)), x). One
    kernel for one row on CUDA when `norm` is Llama's RMSNorm or Gemma's, else the layers one after
    the other. x may be a NormedRow of `norm` (residual None): the kernel finishes the norm."""
    if isinstance(x, NormedRow):
        return _finish_norm(linear, x), x.summed
    fused = one_row_norm_linear(norm, linear, x, residual)
    if fused is not None:
        return fused
    if _kernel_norm(norm) and _quantized_rows(linear, x, x.shape[-1]):
        offset = isinstance(norm, OffsetRMSNorm)
        q, scale, summed = rms_norm_fp8(x, norm.weight, norm.eps, residual, offset)
        y = linear.forward_quantized(q, scale, x.dtype)
        return y, (summed if residual is not None else x)
    if residual is None:
        return linear(norm(x)), x
    h, residual = norm(x, residual)
    return linear(h), residual


def one_row_gated(norm, gate_up, x: torch.Tensor, residual: torch.Tensor | None, activation: str):
    """(act(gate) * up of gate_up(norm(x + residual)), x + residual), the activation applied by
    gate_up's kernel (its epilogue), or None where that does not apply (GATED off, more than one
    row, not CUDA, another norm, activation or linear). bf16/fp16 weights take the norm as their
    prologue too; FP8 weights (no prologue unless FUSE_FP8) follow the norm's own kernel, whatever
    engine.quant.fp8_kernels.ONE_ROW_PATH says."""
    epilogue = _ACT_PROLOGUES.get(activation)
    if not GATED or epilogue is None or not _kernel_norm(norm):
        return None
    if isinstance(x, NormedRow):  # its norm begun by the linear before: this kernel finishes it
        return _finish_norm(gate_up, x, epilogue), x.summed
    k = x.shape[-1]
    operands = _operands(gate_up, x, k)
    if operands is not None:
        weight, scale, bias = operands
        offset = isinstance(norm, OffsetRMSNorm)
        y, summed = row_gemv(
            x, weight, scale, bias, NORM, norm.weight, norm.eps, residual, offset=offset,
            epilogue=epilogue,
        )  # fmt: skip
        return y, (summed if residual is not None else x)
    operands = _operands(gate_up, x, k, prologue=False)
    if operands is None:
        return None
    weight, scale, bias = operands
    h, residual = (norm(x), x) if residual is None else norm(x, residual)
    return row_gemv(h, weight, scale, bias, epilogue=epilogue)[0], residual


def begins_norm(norm) -> bool:
    """Whether a kernel before `norm` may begin it (NORM_AFTER on, and a norm the kernels compute):
    the decoder's question for the linear, or the experts, before each norm."""
    return NORM_AFTER and norm is not None and _kernel_norm(norm)


def linear_add_norm(linear, x: torch.Tensor, residual: torch.Tensor | None, norm):
    """(linear(x), residual), the pair the norm after takes; at one-row decode, when `norm` is
    given (Llama's RMSNorm or Gemma's) and the linear's weights fit the one-row kernel, instead
    (NormedRow of norm(linear(x) + residual), None): the add and the norm's share of the work go
    into the linear's kernel, and the linear after the norm finishes it (NORM_AFTER: off)."""
    operands = (
        _operands(linear, x, x.shape[-1], prologue=False)
        if residual is not None and begins_norm(norm)
        else None
    )
    if operands is None:
        return one_row_linear(linear, x), residual
    weight, scale, bias = operands
    scaled, summed, squares = row_gemv_norm_after(
        x, weight, scale, bias, norm.weight, residual, isinstance(norm, OffsetRMSNorm)
    )
    return NormedRow(scaled, squares, summed, norm), None


def _finish_norm(linear, row: NormedRow, epilogue: int = PLAIN) -> torch.Tensor:
    """linear(norm(...)) of a NormedRow (epilogue: act(gate) * up of it), by the one-row kernel
    where the linear's weights fit it, else from the finished norm."""
    operands = _operands(linear, row.scaled, row.scaled.shape[-1], prologue=False)
    if operands is None:
        h = row.finish()
        return linear(h) if epilogue == PLAIN else gate_and_mul(linear(h), _ACT_NAMES[epilogue])
    weight, scale, bias = operands
    return row_gemv(
        row.scaled, weight, scale, bias, NORMED, eps=row.norm.eps, squares=row.squares,
        epilogue=epilogue,
    )[0]  # fmt: skip


def one_row_linear(linear, x: torch.Tensor) -> torch.Tensor:
    """linear(x), by the one-row kernel without a prologue for one bf16/fp16 row on CUDA
    (attention's o_proj, and down after one_row_gated: faster there than the linear's own skinny
    GEMM at Llama-3.1-8B's and Qwen3-30B-A3B's shapes, bench/row_gemv.py), else by the linear's
    forward."""
    operands = _operands(linear, x, x.shape[-1])
    if operands is None:
        return linear(x)
    weight, scale, bias = operands
    return row_gemv(x, weight, scale, bias, PLAIN)[0]


def act_linear(linear, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """linear(act(gate) * up) of a fused [gate | up] row: one kernel for one SiLU or tanh-GELU row
    on CUDA, else engine.layers.activation.gate_and_mul and the linear."""
    half = gate_up.shape[-1] // 2
    prologue = _ACT_PROLOGUES.get(activation)
    operands = _operands(linear, gate_up, half) if prologue is not None else None
    if operands is None:
        if activation in GATE_ACTIVATIONS and _quantized_rows(linear, gate_up, half):
            q, scale = gate_and_mul_fp8(gate_up, activation)
            return linear.forward_quantized(q, scale, gate_up.dtype)
        return linear(gate_and_mul(gate_up, activation))
    weight, scale, bias = operands
    return row_gemv(gate_up, weight, scale, bias, prologue)[0]
