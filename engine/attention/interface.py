"""The engine's attention interface: what one step's batch looks like to attention
(AttentionMetadata), the one interface every backend implements (AttentionBackend), and the KV
cache's shape.

The runner fills an AttentionMetadata per step; every layer's Attention hands it, with its own slice
of the paged KV cache, to the backend. Backends write the new K/V at `slot_mapping`, then attend
over the whole context.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch


@dataclass
class AttentionMetadata:
    """One step's ragged batch. B sequences, T = sum of their new tokens, flattened in sequence
    order.

    Sequence i contributes query tokens [query_start_loc[i], query_start_loc[i+1]) whose positions
    are the last query_len_i positions of a context of seq_lens[i] tokens (the cached prefix plus
    the new tokens).
    """

    # [T] int64: block_id * block_size + offset, where each new token's K/V goes
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths (device)
    seq_lens: torch.Tensor  # [B] int32, context length after this step (device)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 (device)
    max_query_len: int
    max_seq_len: int
    # Host copies, so the reference backend can loop without device syncs.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    # Leading sequences with one query token each: the runner puts a mixed step's decodes first, so
    # a backend may attend them apart from the prompt chunks.
    num_decode_seqs: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class RotaryTables(NamedTuple):
    """What a backend needs to rotate q and k itself (rotate-half over whole heads, Llama's and
    Qwen's RoPE), after a per-head RMSNorm when q_norm_weight is given (Qwen3's, Gemma 3's; Gemma's
    (1 + w) with norm_offset): the cos/sin tables [positions, D / 2] in q's dtype
    (engine.layers.rotary.RotaryEmbedding's). Each token's position is the one forward's docstring
    gives it (its place in its sequence's context)."""

    cos: torch.Tensor
    sin: torch.Tensor
    q_norm_weight: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    norm_offset: bool = False


def kv_cache_shape(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
):
    """One allocation for the whole cache: [layers, 2 (K, V), blocks, block_size, kv_heads,
    head_dim]."""
    return (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)


class AttentionBackend(ABC):
    """Paged attention over one layer's KV cache [2, num_blocks, block_size, Hkv, D], GQA without
    repeating K/V. Every backend computes the same thing (the torch reference defines it); they
    differ in the devices, dtypes and shapes they take, each refusing the rest with a ValueError
    naming the field."""

    name: ClassVar[str]  # what select_backend() calls it
    # Its decode launches depend on tensor shapes only, so a decode step may be captured in a CUDA
    # graph and replayed.
    supports_cuda_graphs: bool = False
    # The model should store this step's K/V itself (RoPE writing straight into the cache) and call
    # forward(..., kv_written=True); otherwise forward writes them.
    accepts_written_kv: bool = False

    def rotates_in_kernel(
        self, q: torch.Tensor, kv_cache_layer: torch.Tensor, meta: AttentionMetadata
    ) -> bool:
        """Whether forward(..., rotary=...) takes q and k unrotated for this step and rotates them
        itself (with the KV write): none does unless it says so."""
        return False

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        kv_written: bool = False,
        softcap: float | None = None,
        kv_scale: tuple[float, float] = (1.0, 1.0),
        out: torch.Tensor | None = None,
        rotary: RotaryTables | None = None,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D].

        Writes k/v at meta.slot_mapping (unless kv_written: the caller already stored them there,
        and k, v only give shapes), then attends: query token j of sequence i sits at context
        position seq_len_i - query_len_i + j and sees the context positions p <= its own (and, with
        a sliding window W, p > its own - W, as HF Mistral does), scores scaled by `scale` (and
        with `softcap`, Gemma 2's, mapped to softcap * tanh(score / softcap) before the mask).

        An FP8 cache (engine.attention.kv_quant) stores k / kv_scale[0] and v / kv_scale[1],
        clamped to the FP8 range, and reads them back times their scale; other caches ignore
        kv_scale.

        out: a [T, H, D] tensor to write into and return (a CUDA graph's static buffer); rows of
        tokens that belong to no sequence are left as they are.

        rotary: q and k come before their (norm and) rotation, which the backend applies, only
        where rotates_in_kernel said it would; others refuse it."""
