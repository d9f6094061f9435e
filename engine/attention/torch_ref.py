"""Reference paged attention in plain PyTorch (CPU and CUDA; float32, bf16, fp16; a cache in the
model's dtype or FP8): correct first, fast never.

Writes the step's new K/V into the paged cache (FP8: quantized with the layer's scales, see
kv_quant); one batched pass for all decodes, a loop for prefill chunks. An FP8 cache reads back as
the stored values in the model's dtype; the K scale multiplies the fp32 scores and the V scale the
output, as the Triton kernels do.
"""

from __future__ import annotations

import torch

from engine.attention.interface import AttentionBackend, AttentionMetadata, RotaryTables
from engine.attention.kv_quant import is_fp8, quantize


class TorchAttentionBackend(AttentionBackend):
    """The reference: every device and float dtype, a loop over prefill chunks, no CUDA graphs."""

    name = "torch"

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
        """See AttentionBackend.forward."""
        if rotary is not None:
            raise ValueError("rotary: the torch backend takes q and k rotated (rotates_in_kernel)")
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        k_cache, v_cache = kv_cache_layer[0], kv_cache_layer[1]
        block_size = k_cache.shape[1]
        if not kv_written:
            write_kv(k, v, kv_cache_layer, meta.slot_mapping, kv_scale)
        k_scale, v_scale = kv_scale if is_fp8(kv_cache_layer.dtype) else (1.0, 1.0)

        if out is None:
            out = torch.empty_like(q)
        starts = meta.query_start_loc_cpu
        decodes = [i for i in range(meta.num_seqs) if starts[i + 1] - starts[i] == 1]
        if decodes:
            _decode_batch(
                q, k_cache, v_cache, meta, decodes, scale, sliding_window, out, softcap, kv_scale
            )
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            q_start, q_end = starts[i], starts[i + 1]
            q_len = q_end - q_start
            if q_len <= 1:
                continue
            num_blocks = (seq_len + block_size - 1) // block_size
            blocks = meta.block_tables[i, :num_blocks].long()
            # [S, Hkv, D], FP8 read back exactly in q's dtype
            keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].to(q.dtype)
            values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].to(q.dtype)

            # [q_len, H, D] -> [Hkv, group * q_len, D]; head h = kv_head * group + g, as HF's
            # repeat_kv.
            qi = q[q_start:q_end].view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
            qi = qi.reshape(num_kv_heads, group * q_len, head_dim)
            # [Hkv, group * q_len, S]
            scores = torch.matmul(qi, keys.permute(1, 2, 0)).float() * (scale * k_scale)
            scores = _capped(scores, softcap)

            # [q_len, S], True = masked
            mask = _context_mask(seq_len, q_len, sliding_window, q.device)
            scores = scores.view(num_kv_heads, group, q_len, seq_len)
            scores = scores.masked_fill(mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
            probs = probs.view(num_kv_heads, group * q_len, seq_len)
            oi = torch.matmul(probs, values.transpose(0, 1))  # [Hkv, group * q_len, D]
            if v_scale != 1.0:
                oi = (oi.float() * v_scale).to(q.dtype)
            oi = oi.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
            out[q_start:q_end] = oi.reshape(q_len, num_heads, head_dim)
        return out


def _decode_batch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    rows: list[int],
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    softcap: float | None = None,
    kv_scale: tuple[float, float] = (1.0, 1.0),
) -> None:
    """All one-token queries at once: gather each context padded to the longest, mask the
    padding."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    group = num_heads // num_kv_heads
    lens = [meta.seq_lens_cpu[i] for i in rows]
    num_blocks = (max(lens) + block_size - 1) // block_size
    index = torch.tensor(rows, device=q.device)
    tables = meta.block_tables[index, :num_blocks].long()  # [b, nb]
    b, width = len(rows), num_blocks * block_size
    keys = k_cache[tables].reshape(b, width, num_kv_heads, head_dim).to(q.dtype)
    values = v_cache[tables].reshape(b, width, num_kv_heads, head_dim).to(q.dtype)
    k_scale, v_scale = kv_scale if is_fp8(k_cache.dtype) else (1.0, 1.0)
    token = torch.tensor([meta.query_start_loc_cpu[i] for i in rows], device=q.device)
    qd = q[token].view(b, num_kv_heads, group, head_dim)
    # [b, Hkv, group, S]
    scores = torch.einsum("bkgd,bskd->bkgs", qd, keys).float() * (scale * k_scale)
    scores = _capped(scores, softcap)
    k_pos = torch.arange(width, device=q.device)[None, :]
    seq_len = torch.tensor(lens, device=q.device)[:, None]
    mask = k_pos >= seq_len  # padding past each context
    if sliding_window is not None:
        mask |= k_pos <= seq_len - 1 - sliding_window
    scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    # Padding slots hold whatever the cache held (never-written memory can be NaN): 0 * NaN would
    # leak through.
    values = values.masked_fill(mask[:, :, None, None], 0)
    od = torch.einsum("bkgs,bskd->bkgd", probs, values)
    if v_scale != 1.0:
        od = (od.float() * v_scale).to(q.dtype)
    out[token] = od.reshape(b, num_heads, head_dim)


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's soft-cap of scaled scores, softcap * tanh(scores / softcap); unchanged without."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Store k/v [T, Hkv, D] at flat slots (block_id * block_size + offset) of the layer's cache, in
    place; an FP8 cache stores them quantized with kv_scale (K's, V's). Tokens at slot -1 (padding)
    are not stored."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    slots = slot_mapping.long()
    stored = slots >= 0
    if not bool(stored.all()):
        k, v, slots = k[stored], v[stored], slots[stored]
    dtype = kv_cache_layer.dtype
    if is_fp8(dtype):
        k, v = quantize(k, kv_scale[0], dtype), quantize(v, kv_scale[1], dtype)
    # view (not reshape): a non-contiguous cache must fail here rather than write into a silent
    # copy.
    kv_cache_layer[0].view(-1, num_kv_heads, head_dim)[slots] = k.to(dtype)
    kv_cache_layer[1].view(-1, num_kv_heads, head_dim)[slots] = v.to(dtype)


def _context_mask(
    seq_len: int, q_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """[q_len, seq_len] bool, True where query j (at position seq_len - q_len + j) must not see key
    p."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos > q_pos
    if sliding_window is not None:
        mask |= k_pos <= q_pos - sliding_window
    return mask
