"""Paged attention in Triton (CUDA; bf16, fp16, fp32; a cache in that dtype or FP8): the fast path
behind the reference backend's interface.

Writes the step's K/V at slot_mapping, then attends: split-KV decode (merged in the same kernel)
when every query is one token (its launch depends on shapes only: CUDA-graph safe); otherwise the
leading one-token sequences with the decode tiles, split in a fixed count, and the rest with the
prompt tiles, one launch each. A decode step given the model's RoPE tables (rotates_in_kernel)
takes q and k as the qkv projection left them: the attention kernel norms and rotates them and
writes K/V itself, so batch-1 decode has no RoPE or KV-write launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from engine.attention.interface import AttentionBackend, AttentionMetadata, RotaryTables
from engine.attention.kv_quant import FP8_DTYPES, fp8_max, is_fp8
from engine.attention.triton_kernels import (
    merge_splits_kernel,
    paged_attention_kernel,
    write_kv_kernel,
)
from engine.pdl import launch_options

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# an FP8 cache beside q/k/v in one of SUPPORTED_DTYPES
CACHE_DTYPES = SUPPORTED_DTYPES + FP8_DTYPES
MAX_HEAD_DIM = 256
MAX_SPLITS = 64
# Splits per (sequence, kv head) for the decodes of a step that mixes them with prompt chunks: one
# count whatever the step's batch and table width, so one kernel variant (docs/engine.md).
MIXED_DECODE_SPLITS = 4
# Key tiles a decode split takes at least: a context that fits is one program per kv head, which
# stores its output with no partials, atomics or merge (batch-1 decode's latency)
MIN_SPLIT_TILES = 2
# (sequence, kv head) pairs the decode merge counters cover before they must grow
ARRIVAL_SLOTS = 1 << 16
LOG2_E = 1.4426950408889634
# Decode steps rotate q and k (and write the new K/V) inside the attention kernel when the model
# hands over its RoPE tables (rotates_in_kernel); benchmarks turn it off to compare.
ROTATE_IN_KERNEL = True
# (BLOCK_M rows, BLOCK_N keys, num_warps, num_stages[, registers a thread at most: 0 the compiler's
# choice])
TileConfig = tuple[int, ...]
# Default tiles, which fit shared memory. An FP8 cache's decode tiles keep two stages in flight and
# cap a thread at 128 registers, so four programs share an SM (the compiler's choice, 154, fits
# three; bench/results/2026-11-28-h200-decode-registers). fp32 q or heads over 128 dims: small.
DECODE_TILES: TileConfig = (16, 128, 4, 3)
FP8_DECODE_TILES: TileConfig = (16, 128, 4, 2, 128)
SMALL_DECODE_TILES: TileConfig = (16, 32, 4, 2)
PREFILL_TILES: TileConfig = (128, 128, 8, 3)
SMALL_PREFILL_TILES: TileConfig = (64, 32, 4, 2)


@dataclass
class _Launch:
    """What every attention launch of one layer's step shares."""

    q: torch.Tensor
    kv_cache_layer: torch.Tensor
    out: torch.Tensor
    meta: AttentionMetadata
    scale: float
    sliding_window: int | None
    softcap: float | None
    k_scale: float
    v_scale: float
    rotary: RotaryTables | None = None
    k: torch.Tensor | None = None  # the step's new K and V (rotary: the kernel writes them)
    v: torch.Tensor | None = None


class TritonAttentionBackend(AttentionBackend):
    """The CUDA fast path: bf16, fp16, fp32 (an FP8 cache too); head_dim <= 256; decode launches fit
    CUDA graphs."""

    name = "triton"
    supports_cuda_graphs = True  # decode launches depend on tensor shapes only (see forward)
    accepts_written_kv = True  # forward(..., kv_written=True) skips its own KV write

    def __init__(
        self,
        device: torch.device | str | None = None,
        programs_per_sm: int = 8,
        decode_tiles: TileConfig | None = None,
        prefill_tiles: TileConfig | None = None,
        fused_merge: bool = True,
    ) -> None:
        """programs_per_sm sets how far decode splits the context; the tile configs override the
        defaults (bench); fused_merge=False merges decode splits in a second launch (the fallback
        while capturing, kept to compare)."""
        device = torch.device(device) if device is not None else None
        if device is not None and device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        else:
            # interpreter runs on CPU tensors: a small figure still exercises the splits
            self.num_sms = 2
        self.target_programs = programs_per_sm * self.num_sms
        self.decode_tiles = decode_tiles
        self.prefill_tiles = prefill_tiles
        # Split-KV decode counts arriving splits per (sequence, kv head) here; the last one merges
        # and resets its count, so the buffer stays zero between launches. Allocated (zeroed)
        # outside any CUDA-graph capture.
        self.fused_merge = fused_merge
        self.arrivals: torch.Tensor | None = None
        if fused_merge and device is not None and device.type == "cuda":
            self.arrivals = torch.zeros(ARRIVAL_SLOTS, dtype=torch.int32, device=device)

    def rotates_in_kernel(
        self, q: torch.Tensor, kv_cache_layer: torch.Tensor, meta: AttentionMetadata
    ) -> bool:
        """Decode steps (one query token per sequence) over a cache in q's dtype: the attention
        kernel rotates q and k itself and writes the new K/V (no RoPE launch)."""
        return (
            ROTATE_IN_KERNEL
            and meta.max_query_len == 1
            and kv_cache_layer.dtype == q.dtype
            and q.dtype in SUPPORTED_DTYPES
        )

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
        """See AttentionBackend.forward; with kv_written the caller stored this step's K/V
        (RotaryEmbedding.rotate_into_cache); with rotary (where rotates_in_kernel) the attention
        kernel rotates q and k and writes K/V."""
        _check_inputs(q, k, v, kv_cache_layer, sliding_window, softcap)
        rotates = rotary is not None and self.rotates_in_kernel(q, kv_cache_layer, meta)
        if rotary is not None and (kv_written or not rotates):
            raise ValueError(
                "rotary: this step's q and k must come rotated (rotates_in_kernel is False, or "
                "kv_written)"
            )
        num_tokens, _, head_dim = q.shape
        num_kv_heads = k.shape[1]
        block_size = kv_cache_layer.shape[2]
        block_d = triton.next_power_of_2(head_dim)
        k, v, q = _last_dim_contiguous(k), _last_dim_contiguous(v), _last_dim_contiguous(q)
        fp8 = is_fp8(kv_cache_layer.dtype)
        k_scale, v_scale = (float(kv_scale[0]), float(kv_scale[1])) if fp8 else (1.0, 1.0)

        if num_tokens > 0 and not kv_written and rotary is None:
            write_kv_kernel[(num_tokens,)](
                k,
                v,
                kv_cache_layer,
                meta.slot_mapping,
                k.stride(0),
                k.stride(1),
                v.stride(0),
                v.stride(1),
                kv_cache_layer.stride(0),
                1.0 / k_scale,
                1.0 / v_scale,
                NUM_KV_HEADS=num_kv_heads,
                HEAD_DIM=head_dim,
                BLOCK_H=triton.next_power_of_2(num_kv_heads),
                BLOCK_D=block_d,
                FP8=fp8,
                FP8_MAX=fp8_max(kv_cache_layer.dtype) if fp8 else 0.0,
                **launch_options(),
            )
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_seqs = meta.seq_lens.shape[0]
        if num_tokens == 0 or num_seqs == 0:
            return out

        small = q.dtype == torch.float32 or block_d > 128
        decode_tiles = self.decode_tiles or (
            SMALL_DECODE_TILES if small else FP8_DECODE_TILES if fp8 else DECODE_TILES
        )
        prefill_tiles = self.prefill_tiles or (SMALL_PREFILL_TILES if small else PREFILL_TILES)
        a = _Launch(
            q, kv_cache_layer, out, meta, scale, sliding_window, softcap, k_scale, v_scale,
            rotary, k, v,
        )  # fmt: skip
        if meta.max_query_len == 1:  # decode: the launch depends on shapes only (CUDA-graph safe)
            max_context = meta.block_tables.shape[1] * block_size
            num_splits = self._num_splits(
                num_seqs * num_kv_heads, triton.cdiv(max_context, decode_tiles[1])
            )
            self._attend(a, 0, num_seqs, decode_tiles, 1, num_splits)
            return out
        # A step that mixes decodes with prompt chunks: the runner puts the one-token sequences
        # first, and they take the decode tiles (a prompt tile would compute BLOCK_Q rows for each
        # one), split in a fixed count: one that followed the step's batch and table width would
        # make each count a kernel of its own to compile.
        num_decodes = meta.num_decode_seqs
        if num_decodes:
            self._attend(a, 0, num_decodes, decode_tiles, 1, MIXED_DECODE_SPLITS)
        if num_decodes < num_seqs:
            num_prompts = num_seqs - num_decodes
            self._attend(a, num_decodes, num_prompts, prefill_tiles, meta.max_query_len, 1)
        return out

    def _attend(
        self,
        a: _Launch,
        first_seq: int,
        num_seqs: int,
        tiles: TileConfig,
        max_query_len: int,
        num_splits: int,
    ) -> None:
        """One attention launch over sequences [first_seq, first_seq + num_seqs) of the step."""
        q, out, meta, kv_cache_layer = a.q, a.out, a.meta, a.kv_cache_layer
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache_layer.shape[3]
        group = num_heads // num_kv_heads
        # an FP8 cache's dots run over half the dims (its words of two values), at least 16 of them
        block_d = max(triton.next_power_of_2(head_dim), 32 if is_fp8(kv_cache_layer.dtype) else 16)
        block_m, block_n, num_warps, num_stages, *registers = tiles
        block_m = max(block_m, triton.next_power_of_2(group))
        if max_query_len == 1:
            block_q = num_q_tiles = 1
        else:
            block_q = block_m // group
            num_q_tiles = triton.cdiv(max_query_len, block_q)
        fused_merge = (
            num_splits > 1
            and self.fused_merge
            and self._arrivals_for(num_seqs * num_kv_heads, q.device) is not None
        )
        if num_splits > 1:  # one scratch allocation: partial outputs, then their log2-sum-exps
            scratch = torch.empty(
                num_tokens * num_heads * num_splits * (block_d + 1),
                dtype=torch.float32,
                device=q.device,
            )
            part_out, part_lse = scratch.split(
                [num_tokens * num_heads * num_splits * block_d, num_tokens * num_heads * num_splits]
            )
        else:
            part_out = part_lse = out  # unused
        k_cache, v_cache = kv_cache_layer[0], kv_cache_layer[1]
        rope = a.rotary
        # without rotary the kernel reads none of these: any tensor stands in for the pointers
        k_new, v_new = (a.k, a.v) if rope is not None else (q, q)
        cos, sin = (rope.cos, rope.sin) if rope is not None else (q, q)
        qk_norm = rope is not None and rope.q_norm_weight is not None
        q_norm_w, k_norm_w = (rope.q_norm_weight, rope.k_norm_weight) if qk_norm else (q, q)
        paged_attention_kernel[(num_seqs, num_kv_heads * num_splits, num_q_tiles)](
            q,
            k_cache,
            v_cache,
            out,
            part_out,
            part_lse,
            self.arrivals if fused_merge else out,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            # An FP8 cache's K scale multiplies every raw score q.k: folded into both.
            a.scale * a.k_scale * LOG2_E,
            a.sliding_window or 0,
            # the kernel's cap (see _attend_tile)
            a.softcap / (a.scale * a.k_scale) if a.softcap else 1.0,
            a.v_scale,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            meta.block_tables.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            first_seq,
            cos,
            sin,
            q_norm_w,
            k_norm_w,
            k_new,
            v_new,
            meta.slot_mapping,
            k_new.stride(0),
            k_new.stride(1),
            v_new.stride(0),
            v_new.stride(1),
            rope.eps if qk_norm else 0.0,
            NUM_HEADS=num_heads,
            GROUP=group,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_Q=block_q,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            PAGE=kv_cache_layer.shape[2],
            NUM_SPLITS=num_splits,
            USE_WINDOW=a.sliding_window is not None,
            SOFTCAP=a.softcap is not None,
            IEEE=q.dtype == torch.float32,
            FUSED_MERGE=fused_merge,
            BLOCK_S=triton.next_power_of_2(num_splits),
            FP8=is_fp8(kv_cache_layer.dtype),
            MIN_SPLIT_TILES=MIN_SPLIT_TILES if num_splits > 1 else 1,
            ROPE=rope is not None,
            QK_NORM=qk_norm,
            NORM_OFFSET=qk_norm and rope.norm_offset,
            num_warps=num_warps,
            num_stages=num_stages,
            **({"maxnreg": registers[0]} if registers and registers[0] else {}),
            **launch_options(),
        )
        if num_splits > 1 and not fused_merge:
            merge_splits_kernel[(num_tokens, num_heads)](
                out,
                part_out,
                part_lse,
                out.stride(0),
                out.stride(1),
                NUM_HEADS=num_heads,
                HEAD_DIM=head_dim,
                BLOCK_D=block_d,
                NUM_SPLITS=num_splits,
                BLOCK_S=triton.next_power_of_2(num_splits),
                num_warps=4 if block_d >= 128 else 2,
                **launch_options(),
            )

    def _arrivals_for(self, slots: int, device: torch.device) -> torch.Tensor | None:
        """The zeroed arrival counts for `slots` (sequence, kv head) pairs, grown outside graph
        capture; None while capturing with too few (a zero-fill recorded in a graph would not run
        before eager use)."""
        arrivals = self.arrivals
        if arrivals is not None and arrivals.numel() >= slots and arrivals.device == device:
            return arrivals
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        self.arrivals = torch.zeros(max(slots, ARRIVAL_SLOTS), dtype=torch.int32, device=device)
        return self.arrivals

    def _num_splits(self, programs: int, max_tiles: int) -> int:
        """Splits per (sequence, kv head): enough programs to fill the GPU, never more than the
        context has tiles."""
        return max(1, min(triton.cdiv(self.target_programs, programs), max_tiles, MAX_SPLITS))


def _check_inputs(q, k, v, kv_cache_layer, sliding_window, softcap=None) -> None:
    """Refuse what the kernels cannot do, naming the field and its limit."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be [tokens, heads, head_dim]: got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    head_dim = q.shape[2]
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim={head_dim}: the triton attention backend supports head_dim <= {MAX_HEAD_DIM}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"num_heads={q.shape[1]} must be a multiple of num_kv_heads={k.shape[1]}")
    if kv_cache_layer.dtype not in CACHE_DTYPES:
        raise ValueError(
            f"kv cache dtype {kv_cache_layer.dtype}: the triton backend supports {CACHE_DTYPES}"
        )
    if is_fp8(kv_cache_layer.dtype) and head_dim % 2:
        raise ValueError(
            f"head_dim={head_dim} with an FP8 kv cache: the triton backend reads that cache in "
            "pairs of values and takes an even head_dim"
        )
    if is_fp8(kv_cache_layer.dtype) and q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"q dtype {q.dtype} with an FP8 kv cache: the triton backend takes q in "
            f"{SUPPORTED_DTYPES}"
        )
    if kv_cache_layer.shape[3:] != k.shape[1:] or kv_cache_layer.shape[0] != 2:
        raise ValueError(
            f"kv_cache_layer {tuple(kv_cache_layer.shape)} must be "
            f"[2, blocks, block_size, {k.shape[1]}, {head_dim}]"
        )
    if not kv_cache_layer.is_contiguous():
        raise ValueError(
            "kv_cache_layer must be contiguous (a slice of the one [layers, 2, ...] allocation)"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be >= 1")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap} must be > 0")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
