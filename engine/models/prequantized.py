"""Turns the tensors of an FP8 checkpoint (engine.checkpoint_quant names its format) into what the
engine's FP8 linears load, as they stream out of safetensors: each FP8 weight paired with its scale
tensor, the static activation scales dropped.

Weights with one scale per tensor or per output channel arrive as QuantizedRows, which an FP8
linear keeps as they are (the same FP8 values, one scale per row); block-scaled weights are
multiplied out in float32 and quantized again per output channel.

Mixture-of-experts checkpoints carry one FP8 weight per expert and projection, each with its scale
(as the hub's publish them: experts.E.gate_proj.weight_scale_inv), or, as transformers writes them,
with one stacked scale per layer (experts.gate_up_proj_scale_inv [E, gate and up blocks, K
blocks], experts.down_proj_scale_inv), which is cut into each expert's here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.checkpoint_quant import CheckpointFp8
from engine.models.checkpoint_names import text_decoder_name
from engine.models.moe_weights import expert_projection_names
from engine.quant.base import QuantizedRows

if TYPE_CHECKING:
    from engine.models.decoder import WeightSlot

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Activation and KV scales a checkpoint may carry: the engine quantizes activations dynamically
# per token.
_DROPPED_SUFFIXES = (".input_scale", ".output_scale", ".k_scale", ".v_scale")


def checkpoint_weights(
    tensors: Iterator[tuple[str, torch.Tensor]],
    fmt: CheckpointFp8,
    slots: dict[str, "WeightSlot"] | None = None,
    experts: "ExpertLayout | None" = None,
) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
    """(name, tensor) of a checkpoint, with every FP8 weight paired with its scale tensor (in any
    order, across shards) and yielded once (weight_rows); other tensors pass through. With `slots`
    (a tensor-parallel rank's hf_weight_map), a weight named there arrives as its slot's slice and
    its scales are cut to match. `experts`: a mixture of experts' names and rows, into which a
    layer's stacked expert scales are cut (per_expert_scales). Raises ValueError for an FP8 weight
    without a scale, or a scale without a weight."""
    slots = slots or {}
    if experts is not None:
        tensors = per_expert_scales(tensors, fmt, experts)

    def rows(prefix: str, weight: torch.Tensor, scale: torch.Tensor):
        return weight_rows(weight, scale, fmt, slots.get(text_decoder_name(prefix + ".weight")))

    scale_suffix = "." + fmt.scale_name
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name.endswith(_DROPPED_SUFFIXES):
            continue
        if name.endswith(scale_suffix):
            prefix = name.removesuffix(scale_suffix)
            if prefix in weights:
                yield prefix + ".weight", rows(prefix, weights.pop(prefix), tensor)
            else:
                scales[prefix] = tensor
        elif name.endswith(".weight") and tensor.dtype in FP8_DTYPES:
            prefix = name.removesuffix(".weight")
            if prefix in scales:
                yield name, rows(prefix, tensor, scales.pop(prefix))
            else:
                weights[prefix] = tensor
        else:
            yield name, tensor
    if weights or scales:
        lone = sorted(weights)[:1] + sorted(scales)[:1]
        raise ValueError(
            f"weights: FP8 weights and their {fmt.scale_name} tensors don't pair up "
            f"(e.g. {lone}): the checkpoint is incomplete; fetch it again"
        )


_STACKED_SCALES = ("experts.gate_up_proj", "experts.down_proj")


@dataclass(frozen=True)
class ExpertLayout:
    """A checkpoint's per-expert (gate, up, down) projection names and the rows of each gate or up
    projection (the expert's intermediate size)."""

    names: tuple[str, str, str]
    rows: int


def expert_layout(family: str, rows: int) -> ExpertLayout | None:
    """The family's ExpertLayout; None for a family without experts."""
    names = expert_projection_names(family)
    return ExpertLayout(names, rows) if names is not None else None


def per_expert_scales(
    tensors: Iterator[tuple[str, torch.Tensor]], fmt: CheckpointFp8, experts: ExpertLayout
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors, with each stacked expert scale (transformers' experts.gate_up_proj_scale_inv
    [E, ...], experts.down_proj_scale_inv) replaced by every expert's own, named as its weight's
    (experts.E.<gate>/<up>/<down>.weight_scale_inv). The gate and up projections split on a block
    boundary only: a block straddling them (rows not a multiple of the block's) raises
    ValueError."""
    gate, up, down = experts.names
    suffix = "_" + fmt.scale_name.removeprefix("weight_")  # gate_up_proj_scale_inv
    for name, tensor in tensors:
        stacked = next((s for s in _STACKED_SCALES if name.endswith(f".{s}{suffix}")), None)
        if stacked is None:
            yield name, tensor
            continue
        prefix = name.removesuffix(suffix).removesuffix(stacked.split(".")[1])
        if stacked == "experts.down_proj":
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.{down}.{fmt.scale_name}", tensor[e]
            continue
        block_rows = fmt.block[0] if fmt.block else 0
        if not block_rows or experts.rows % block_rows:
            raise ValueError(
                f"weights: {name}: the gate and up projections ({experts.rows} rows each) of "
                f"an expert don't split on a {fmt.block} block boundary"
            )
        half = experts.rows // block_rows
        for e in range(tensor.shape[0]):
            yield f"{prefix}{e}.{gate}.{fmt.scale_name}", tensor[e, :half]
            yield f"{prefix}{e}.{up}.{fmt.scale_name}", tensor[e, half:]


def weight_rows(
    weight: torch.Tensor, scale: torch.Tensor, fmt: CheckpointFp8, slot: "WeightSlot | None" = None
) -> torch.Tensor | QuantizedRows:
    """An FP8 weight with its scale: one value or one per output channel ([N] or [N, 1]) ->
    QuantizedRows; one per block ([ceil(N/bn), ceil(K/bk)]) -> the float32 product. With a `slot`
    whose slice is not the whole tensor, `weight` is that slice of the [N, K] checkpoint tensor."""
    n, k = slot.full if slot is not None else weight.shape
    part = slot is not None and slot.count != slot.full[slot.dim]
    s = scale.float()
    if fmt.weight_scales == "block":
        bn, bk = fmt.block
        grid = ((n + bn - 1) // bn, (k + bk - 1) // bk)
        if s.dim() == 1 and 1 in grid and s.numel() == grid[0] * grid[1]:
            s = s.reshape(grid)  # transformers 5.17 writes a grid of one row or column flat
        if tuple(s.shape) != grid:
            raise ValueError(
                f"weights: a [{n}, {k}] FP8 weight with {bn}x{bk} blocks needs a {list(grid)} "
                f"scale grid, got {list(s.shape)}"
            )
        s = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        if part:
            s = s.narrow(slot.dim, slot.first, slot.count)
        return weight.float() * s
    if s.numel() not in (1, n):
        raise ValueError(
            f"weights: a [{n}, {k}] FP8 weight's scale has shape {list(s.shape)}: expected one "
            f"value or {n} (one per output channel)"
        )
    if part and slot.dim == 0 and s.numel() == n > 1:  # this rank's output channels
        s = s.reshape(-1)[slot.first : slot.first + slot.count]
    return QuantizedRows(weight, s)
