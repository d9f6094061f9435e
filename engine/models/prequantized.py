"""Turns the tensors of an FP8 checkpoint (engine.checkpoint_quant names its format) into the
full-precision weights they stand for, as they stream out of safetensors: each FP8 weight times its
scale (one per tensor, per output channel, or per block), the scale tensors and static activation
scales dropped.

The engine's own FP8 scheme then quantizes those weights again, per output channel, in the layout
its kernels read; per-channel checkpoints come back to the same FP8 values.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engine.checkpoint_quant import CheckpointFp8

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Activation and KV scales a checkpoint may carry: the engine quantizes activations dynamically
# per token (at least as fine as one static scale per tensor).
_DROPPED_SUFFIXES = (".input_scale", ".output_scale", ".k_scale", ".v_scale")


def dequantized(
    tensors: Iterator[tuple[str, torch.Tensor]], fmt: CheckpointFp8, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a checkpoint, with every FP8 weight paired with its scale tensor (in any
    order, across shards) and yielded as one `dtype` tensor; other tensors pass through. Raises
    ValueError for an FP8 weight without a scale, or a scale without a weight."""
    scale_suffix = "." + fmt.scale_name
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name.endswith(_DROPPED_SUFFIXES):
            continue
        if name.endswith(scale_suffix):
            prefix = name.removesuffix(scale_suffix)
            if prefix in weights:
                yield prefix + ".weight", dequantize(weights.pop(prefix), tensor, fmt, dtype)
            else:
                scales[prefix] = tensor
        elif name.endswith(".weight") and tensor.dtype in FP8_DTYPES:
            prefix = name.removesuffix(".weight")
            if prefix in scales:
                yield name, dequantize(tensor, scales.pop(prefix), fmt, dtype)
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


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, fmt: CheckpointFp8, dtype: torch.dtype
) -> torch.Tensor:
    """weight [N, K] (FP8) times its scale, in float32, cast to `dtype`. The scale is one value,
    one per output channel ([N] or [N, 1]), or one per block ([ceil(N/bn), ceil(K/bk)])."""
    n, k = weight.shape
    s = scale.float()
    if fmt.weight_scales == "block":
        bn, bk = fmt.block
        grid = ((n + bn - 1) // bn, (k + bk - 1) // bk)
        if tuple(s.shape) != grid:
            raise ValueError(
                f"weights: a [{n}, {k}] FP8 weight with {bn}x{bk} blocks needs a {list(grid)} "
                f"scale grid, got {list(s.shape)}"
            )
        s = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    elif s.numel() == n and n > 1:
        s = s.reshape(n, 1)
    elif s.numel() == 1:
        s = s.reshape(1, 1)
    else:
        raise ValueError(
            f"weights: a [{n}, {k}] FP8 weight's scale has shape {list(s.shape)}: expected one "
            f"value or {n} (one per output channel)"
        )
    return (weight.float() * s).to(dtype)
