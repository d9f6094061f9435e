"""Rotary position embeddings (neox-style rotate-half, as HF Llama/Qwen): a cos/sin cache for every
position.

Supports the rope types of ModelConfig.rope: "default", "linear" (positions / factor), "llama3"
(banded rescale) and "longrope" (Phi-3: per-frequency factors, scaled cos/sin), and partial rotary
(the first rotary_dim dims of a head); on CUDA one Triton kernel rotates whole heads q and k (after
Qwen3's or Gemma 3's per-head q/k norm when given), or writes k, v to the cache.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.config import RopeConfig
from engine.layers.fused import fused_kernels_available, rope_fused
from engine.layers.norm import OffsetRMSNorm, RMSNorm


def compute_inv_freq(head_dim: int, rope: RopeConfig, max_position_embeddings: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32 on CPU (so every device starts from the same
    numbers)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope, max_position_embeddings)
    if rope.rope_type == "longrope":
        factors = torch.tensor(_longrope_factors(rope, max_position_embeddings))
        return 1.0 / (factors * rope.theta**exponents)
    raise ValueError(f"rope type {rope.rope_type!r} is not supported")


def _llama3_scale(
    inv_freq: torch.Tensor, rope: RopeConfig, max_position_embeddings: int
) -> torch.Tensor:
    """Llama 3.1: long wavelengths slow down by `factor`, short ones stay, the band between is
    interpolated."""
    old_len = rope.original_max_position_embeddings or max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor  # longer than this: fully scaled
    high_freq_wavelen = old_len / rope.high_freq_factor  # shorter than this: untouched
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    interpolated = (1 - smooth) * scaled / rope.factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, interpolated, scaled)


def _longrope_factors(rope: RopeConfig, max_position_embeddings: int) -> tuple[float, ...]:
    """Phi-3's longrope: the long factors when the engine serves contexts past
    original_max_position_embeddings, else the short ones, for every position alike."""
    served = rope.serving_len or max_position_embeddings
    original = rope.original_max_position_embeddings or max_position_embeddings
    return rope.long_factor if served > original else rope.short_factor


def cos_sin_scale(rope: RopeConfig) -> float:
    """The factor cos and sin are multiplied by (longrope's attention factor; 1 otherwise)."""
    if rope.rope_type == "longrope" and rope.attention_factor is not None:
        return rope.attention_factor
    return 1.0


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D/2] -> x rotated:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def norm_operands(q_norm: RMSNorm, k_norm: RMSNorm) -> dict:
    """rope_fused's keywords for per-head q/k norms (Gemma's: the (1 + w) form); also the fields
    of engine.attention.RotaryTables."""
    return dict(
        q_norm_weight=q_norm.weight,
        k_norm_weight=k_norm.weight,
        eps=q_norm.eps,
        norm_offset=isinstance(q_norm, OffsetRMSNorm),
    )


class RotaryEmbedding(nn.Module):
    """Holds cos/sin [max_positions, rotary_dim // 2] in the model dtype; rotates q [T, H, D] and
    k [T, Hkv, D] (their first rotary_dim dims; all by default, as Phi-3's partial rotary asks)."""

    def __init__(
        self,
        head_dim: int,
        rope: RopeConfig,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.max_positions = max_positions
        inv_freq = compute_inv_freq(self.rotary_dim, rope, max_positions).to(device)
        freqs = (
            torch.arange(max_positions, dtype=torch.float32, device=device)[:, None]
            * inv_freq[None, :]
        )
        # Computed (and scaled) in float32 then cast, as HF does before rotating in the
        # activations' dtype.
        scale = cos_sin_scale(rope)
        self.register_buffer("cos", (freqs.cos() * scale).to(dtype), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scale).to(dtype), persistent=False)

    def _fusable(self, q: torch.Tensor, q_norm) -> bool:
        """The fused kernel rotates whole heads and applies Llama's RMSNorm or Gemma's."""
        known_norm = q_norm is None or type(q_norm) in (RMSNorm, OffsetRMSNorm)
        return self.rotary_dim == self.head_dim and known_norm and fused_kernels_available(q)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, H, D] and k [T, Hkv, D] by position; with q_norm/k_norm, normalise each head
        first."""
        if self._fusable(q, q_norm):
            if q_norm is None:
                return rope_fused(positions, q, k, self.cos, self.sin)
            return rope_fused(positions, q, k, self.cos, self.sin, **norm_operands(q_norm, k_norm))
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        cos = self.cos[positions]
        sin = self.sin[positions]
        if self.rotary_dim < self.head_dim:
            return self._rotate_part(q, cos, sin), self._rotate_part(k, cos, sin)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def _rotate_part(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x with its first rotary_dim dims rotated and the rest passed through."""
        rotated = apply_rotary(x[..., : self.rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1)

    def can_write_cache(
        self, q: torch.Tensor, kv_cache_layer: torch.Tensor, q_norm: RMSNorm | None = None
    ) -> bool:
        """True when rotate_into_cache can serve this layer (CUDA kernels, whole heads rotated, a
        plain q/k RMSNorm if any, a contiguous cache in q's dtype)."""
        return (
            self._fusable(q, q_norm)
            and kv_cache_layer.dtype == q.dtype
            and kv_cache_layer.is_contiguous()
        )

    def rotate_into_cache(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        slot_mapping: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """forward's rotation, with the rotated k and v written into the paged cache at slot_mapping
        in the same kernel (see can_write_cache); returns the rotated q."""
        norm = {} if q_norm is None else norm_operands(q_norm, k_norm)
        q, _ = rope_fused(
            positions,
            q,
            k,
            self.cos,
            self.sin,
            v=v,
            kv_cache_layer=kv_cache_layer,
            slot_mapping=slot_mapping,
            **norm,
        )
        return q
