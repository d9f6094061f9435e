"""The engine's attention interface: what one step's batch looks like to attention, and how backends are chosen.

The runner fills an AttentionMetadata per step; every layer's Attention hands it, with its own slice of the paged
KV cache, to the backend. Backends write the new K/V at `slot_mapping`, then attend over the whole context.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """One step's ragged batch. B sequences, T = sum of their new tokens, flattened in sequence order.

    Sequence i contributes query tokens [query_start_loc[i], query_start_loc[i+1]) whose positions are the last
    query_len_i positions of a context of seq_lens[i] tokens (the cached prefix plus the new tokens).
    """

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset where each new token's K/V goes
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths (device)
    seq_lens: torch.Tensor  # [B] int32, context length after this step (device)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 (device)
    max_query_len: int
    max_seq_len: int
    # Host copies, so the reference backend can loop without device syncs.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


def kv_cache_shape(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int):
    """One allocation for the whole cache: [layers, 2 (K, V), blocks, block_size, kv_heads, head_dim]."""
    return (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)


BACKEND_NAMES = ("auto", "torch", "triton")


def select_backend(device: torch.device | str, name: str = "auto"):
    """The attention backend for `device`: "auto" is triton on CUDA when triton imports, else the torch reference.

    Triton is imported only when it is chosen, so CPU paths never load it.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention backend {name!r} is not one of {', '.join(repr(n) for n in BACKEND_NAMES)}")
    device = torch.device(device)
    if name in ("auto", "triton") and device.type == "cuda":
        try:
            from engine.attention.triton_attn import TritonAttentionBackend
        except ImportError as exc:
            if name == "triton":
                raise ValueError(f"attention backend 'triton' needs the triton package: {exc}") from exc
        else:
            return TritonAttentionBackend(device)
    elif name == "triton":
        raise ValueError(f"attention backend 'triton' needs a CUDA device, got {device}")
    from engine.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend()
