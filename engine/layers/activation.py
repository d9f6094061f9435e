"""Fused activations of the MLP: SiLU(gate) * up (or Gemma's GELU(gate) * up) on the output of one
fused gate_up projection.

The fused tensor holds the gate in its first half and the up projection in its second half (last
dim); on CUDA one Triton kernel computes either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.fused import fused_kernels_available, gate_and_mul_fused, silu_and_mul_fused


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] -> [..., I]: silu(gate_up[..., :I]) * gate_up[..., I:]."""
    if fused_kernels_available(gate_up):
        return silu_and_mul_fused(gate_up)
    return silu_and_mul_reference(gate_up)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """The plain torch computation (the CPU path)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# transformers' activation names -> F.gelu's `approximate`
_GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


def gate_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """[..., 2 * I] -> [..., I]: activation(gate) * up, `activation` as transformers names it
    ("silu", "gelu_pytorch_tanh", "gelu")."""
    if activation == "silu":
        return silu_and_mul(gate_up)
    if activation not in _GELU_APPROXIMATIONS:
        raise ValueError(f"hidden_act: {activation!r} is not supported")
    if fused_kernels_available(gate_up):
        return gate_and_mul_fused(gate_up, activation)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate=_GELU_APPROXIMATIONS[activation]) * up
