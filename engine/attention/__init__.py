"""Attention for the engine: the interface (AttentionMetadata, AttentionBackend, the KV cache's
shape) and the choice of backend: plain PyTorch (`torch_ref`, any device, the reference) or Triton
(`triton_attn`, CUDA).
"""

from __future__ import annotations

import torch

from engine.attention.interface import (
    AttentionBackend,
    AttentionMetadata,
    RotaryTables,
    kv_cache_shape,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BACKEND_NAMES",
    "RotaryTables",
    "kv_cache_shape",
    "select_backend",
]

BACKEND_NAMES = ("auto", "torch", "triton")


def select_backend(device: torch.device | str, name: str = "auto") -> AttentionBackend:
    """The attention backend for `device`: "auto" is triton on CUDA when triton imports, else the
    torch reference.

    Triton is imported only when it is chosen, so CPU paths never load it.
    """
    if name not in BACKEND_NAMES:
        names = ", ".join(repr(n) for n in BACKEND_NAMES)
        raise ValueError(f"attention backend {name!r} is not one of {names}")
    device = torch.device(device)
    if name in ("auto", "triton") and device.type == "cuda":
        try:
            from engine.attention.triton_attn import TritonAttentionBackend
        except ImportError as exc:
            if name == "triton":
                raise ValueError(
                    f"attention backend 'triton' needs the triton package: {exc}"
                ) from exc
        else:
            return TritonAttentionBackend(device)
    elif name == "triton":
        raise ValueError(f"attention backend 'triton' needs a CUDA device, got {device}")
    from engine.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend()
