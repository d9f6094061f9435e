"""Fused activations of the MLP: SiLU(gate) * up on the output of one fused gate_up projection.

The fused tensor holds the gate in its first half and the up projection in its second half (last
dim); on CUDA one Triton kernel computes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.fused import fused_kernels_available, silu_and_mul_fused


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] -> [..., I]: silu(gate_up[..., :I]) * gate_up[..., I:]."""
    if fused_kernels_available(gate_up):
        return silu_and_mul_fused(gate_up)
    return silu_and_mul_reference(gate_up)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """The plain torch computation (the CPU path)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
