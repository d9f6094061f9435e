"""A decoder layer's linears with the norm or activation beside them, each pair run by one kernel
where one applies (engine/layers/row_gemv.py's one-row GEMV), else as the layers one after the
other. The decoder's only way to its linears: norm_linear (attention's qkv), one_row_gated and
act_linear (the MLP), linear_add_norm (o_proj and down, before the next norm), one_row_linear.

At one decode row: linear(rms_norm(x + residual)) (qkv, gate_up; Llama's norm or Gemma's (1 + w))
or linear(act(gate) * up) (down; SiLU or Gemma's tanh GELU) in one kernel, the norm or activation
its prologue. The activation can instead close gate_up's kernel (its epilogue), so that down reads
act(gate) * up, half as wide, with no prologue: the MLP's path when GATED (one_row_gated).

The norm can instead be split over the two linears around it (NORM_AFTER, at Llama-style
layers): the kernel of the linear before it (o_proj; down, for the next layer's norm) adds the
residual to its output rows and begins the norm (row_gemv's EPILOGUE NORM), and the kernel of the
linear after it finishes it (PROLOGUE NORMED): a NormedRow passed between them (linear_add_norm,
norm_linear, one_row_gated). Every program then reads one row, not the row, the residual and the
norm weight, and FP8 weights lose the norm's own kernel (bench/results/2026-11-28-h100-norm-after/).

Who takes the one-row kernel: one row on CUDA (row_gemv_applies; FUSE turns it off), an RMSNorm
(Llama's or Gemma's) and a linear whose one_row_operands() gives (weight, scale, bias) with its
weight in the activation dtype, or FP8 with its scales without a prologue, or with one when
FUSE_FP8 (row-parallel linears give none: they all-reduce after). FP8 weights do not take the norm
and SiLU prologues by default: fused, FP8 decode measured slower than its GEMV after a norm kernel
(bench/results/2026-11-27-h100-row-gemv/, and again with programmatic dependent launch:
bench/results/2026-11-27-h100-pdl/), since every program reads the residual, the row and the norm
weight beside only half the bytes of weight a bf16 program reads. bench/fp8_decode.py --prologues
and --fp8-prologues measure both.

More rows, FP8 linears quantize their input per token before their tensor-core GEMM; norm_linear
and act_linear then have the norm or the gate activation write its rows quantized instead
(engine.layers.fused: rms_norm_fp8, gate_and_mul_fp8; FUSE_QUANTIZE), so the quantizer is not a
launch of its own.
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
from engine.layers.row_gemv import (
    GELU_MUL,
    NORM,
    NORMED,
    PLAIN,
    SILU_MUL,
    row_gemv,
    row_gemv_norm_after,
)

FUSE = True  # the fused one-row path on (benchmarks turn it off to compare)
FUSE_FP8 = False  # FP8 weights take the prologues too (benchmarks compare)
# the norm or gate activation before an FP8 linear that quantizes its rows per token writes them
# quantized (_quantized_rows; benchmarks turn it off to compare)
FUSE_QUANTIZE = True
GATED = True  # gate_up's kernel applies act(gate) * up (one_row_gated; benchmarks turn it off)
# the next norm begun in the kernel of the linear before it (linear_add_norm; benchmarks turn it
# off)
NORM_AFTER = True
_ACT_PROLOGUES = {"silu": SILU_MUL, "gelu_pytorch_tanh": GELU_MUL}
_ACT_NAMES = {code: name for name, code in _ACT_PROLOGUES.items()}


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


def row_gemv_applies(x: torch.Tensor) -> bool:
    """True when x is one bf16/fp16 row on CUDA and the fused path is on (the kernel set's trace
    sees meta tensors as CUDA here: warmup.kernel_set)."""
    return (
        FUSE
        and fused_kernels_available(x)
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
