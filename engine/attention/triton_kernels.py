"""Triton kernels of the paged attention backend: the KV-cache write, one attention kernel, the
split merge.

The attention kernel packs a kv head's whole query-head group into the rows of each tile, so a K/V
tile is read once for all of them; decode runs it split along the context (flash-decoding), prefill
one program per query tile. An FP8 cache is read in 16-bit words of two values and widened to fp16
by moving bits (_widen_pairs).
"""

from __future__ import annotations

import triton
import triton.language as tl

from engine.norm_rounding import weighted_norm
from engine.pdl import release

# an e4m3 value widened by moving its bits into fp16's places reads as the value / 2**8 (the two
# formats' exponent biases, 7 and 15, differ by 8)
E4M3_WIDEN = tl.constexpr(256.0)


@triton.jit
def write_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kv,
    k_inv_scale,
    v_inv_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per new token: copy its K and V rows [Hkv, D] to its flat slot; a negative slot
    is padding. FP8: x * (1 / scale) in fp32, clamped to +-FP8_MAX, cast rounding to nearest even
    (engine.attention.kv_quant.quantize, byte for byte)."""
    release(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    dst = cache_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + h * HEAD_DIM + d
    key = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    value = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    if FP8:
        key = tl.clamp(key.to(tl.float32) * k_inv_scale, -FP8_MAX, FP8_MAX)
        value = tl.clamp(value.to(tl.float32) * v_inv_scale, -FP8_MAX, FP8_MAX)
    tl.store(dst, key.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv, value.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tanh(x):
    """tanh(x) = 1 - 2 / (exp(2x) + 1), exact at both ends (exp overflowing to inf gives 1)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


# The widening's bit moves on 32-bit registers of two words (four FP8 values), as PTX; Triton's
# interpreter (the CPU tests) runs no PTX and takes the same moves per word.
_E4M3_PAIRS_PTX = tl.constexpr("""{
.reg .b32 lo, hi;
shl.b32 lo, $2, 8;
shl.b32 hi, $2, 7;
and.b32 lo, lo, 0x80008000;
and.b32 hi, hi, 0x3F803F80;
or.b32 $0, lo, hi;
shr.b32 lo, $2, 1;
and.b32 lo, lo, 0x3F803F80;
and.b32 hi, $2, 0x80008000;
or.b32 $1, lo, hi;
}""")
_E5M2_PAIRS_PTX = tl.constexpr("""{
shl.b32 $0, $2, 8;
and.b32 $0, $0, 0xFF00FF00;
and.b32 $1, $2, 0xFF00FF00;
}""")
INTERPRETED = tl.constexpr(triton.knobs.runtime.interpret)


@triton.jit
def _widen_pairs(pairs, E5M2: tl.constexpr):
    """uint16 words holding two FP8 values each (dims 2i and 2i + 1) -> two fp16 tensors (the even
    dims, the odd), by moving bits: an e5m2 value is the high byte of the fp16 equal to it; an e4m3
    value's sign, exponent and mantissa are fp16's, shifted 7 lower, so the fp16 they make is the
    value / E4M3_WIDEN (exact, subnormals too; the kernel puts the factor in its scales)."""
    if INTERPRETED:
        if E5M2:
            even = pairs << 8
            odd = pairs & 0xFF00
        else:
            even = ((pairs & 0x80) << 8) | ((pairs & 0x7F) << 7)
            odd = (pairs & 0x8000) | ((pairs >> 1) & 0x3F80)
        return (
            even.to(tl.uint16).to(tl.float16, bitcast=True),
            odd.to(tl.uint16).to(tl.float16, bitcast=True),
        )
    else:
        return tl.inline_asm_elementwise(
            _E5M2_PAIRS_PTX if E5M2 else _E4M3_PAIRS_PTX,
            "=r,=r,r",
            [pairs],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=2,
        )


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b in fp32: exact fp32 products under IEEE (fp32 q), the tensor cores' inputs else."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attend_tile(
    acc,
    acc_odd,
    m_i,
    l_i,
    q,
    q_odd,
    start,
    end,
    table_row,
    k_base,
    v_base,
    q_pos,
    d,
    d_mask,
    scale_log2,
    window,
    cap,
    stride_cb,
    stride_cs,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FP8: tl.constexpr,
    E5M2: tl.constexpr,
):
    """Fold keys [start, start + BLOCK_N) (those < end) into the running softmax (log2 domain,
    fp32).

    MASKED=False is for tiles wholly inside the context and below every row's position: no bounds,
    no mask. FP8: the cache is read in uint16 words of two values (k_base and v_base point at
    words; d, d_mask and the strides count words; HEAD_DIM and BLOCK_D count dims, and as both
    are even they differ in words exactly when they differ in dims), widened by moving
    bits into the even dims and the odd dims (_widen_pairs): q, q_odd and acc, acc_odd hold those
    halves, and each product is two dots. Read this way a tile takes the 16-bit operand path (the
    shared-memory matrix loads) that FP8 bytes do not. The scales are applied outside (K's in
    scale_log2 and cap, V's to the output). Otherwise acc_odd and q_odd are not read.
    """
    n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        in_range = n < end
        page = tl.load(table_row + n // PAGE, mask=in_range, other=0).to(tl.int64)
        kv_mask = in_range[:, None] & d_mask[None, :]
    else:  # a whole tile inside the context: no bounds to check
        page = tl.load(table_row + n // PAGE).to(tl.int64)
        kv_mask = d_mask[None, :] if HEAD_DIM != BLOCK_D else None
    offs = page * stride_cb + (n % PAGE) * stride_cs
    key = tl.load(
        k_base + offs[:, None] + d[None, :],
        mask=kv_mask,
        other=0 if kv_mask is not None else None,
    )
    if FP8:
        key, key_odd = _widen_pairs(key, E5M2)
        s = _dot(q, tl.trans(key.to(q.dtype)), IEEE)
        s += _dot(q_odd, tl.trans(key_odd.to(q.dtype)), IEEE)
    else:
        s = _dot(q, tl.trans(key), IEEE)
    if (
        SOFTCAP
    ):  # Gemma 2: s * scale -> softcap * tanh(s * scale / softcap), with cap = softcap / scale
        s = cap * _tanh(s / cap)
    if MASKED:
        visible = (n[None, :] <= q_pos[:, None]) & in_range[None, :]
        if USE_WINDOW:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    # scale_log2 > 0, so scaling the row max equals the max of the scaled row; s * scale - m is one
    # FMA.
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * scale_log2 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    value = tl.load(
        v_base + offs[:, None] + d[None, :],
        mask=kv_mask,
        other=0 if kv_mask is not None else None,
    )
    if FP8:
        value, value_odd = _widen_pairs(value, E5M2)
        p = p.to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p, value.to(q.dtype), IEEE)
        acc_odd = acc_odd * alpha[:, None] + _dot(p, value_odd.to(q.dtype), IEEE)
    else:
        acc = acc * alpha[:, None] + _dot(p.to(value.dtype), value, IEEE)
    return acc, acc_odd, m_new, l_i


@triton.jit
def _rope_operands(
    head_ptrs, row_ok, pos, d, cos_ptr, sin_ptr, norm_w_ptr,
    HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr,
):  # fmt: skip
    """The loads _normed_rotated works from, issued together (none waits for another): rows of
    heads [M, BLOCK_D] (head_ptrs [M, 1] point at each head; rows with row_ok), the same rows with
    each dim d's partner d +- HEAD_DIM / 2 in its place, cos/sin at positions pos [M] for each dim,
    and the q/k norm's weight in both orders (QK_NORM; otherwise cos stands in)."""
    half = HEAD_DIM // 2
    first = d < half
    partner = tl.where(first, d + half, d - half)
    in_head = d < HEAD_DIM
    mask = row_ok[:, None] & in_head[None, :]
    x = tl.load(head_ptrs + d[None, :], mask=mask, other=0.0)
    xp = tl.load(head_ptrs + partner[None, :], mask=mask, other=0.0)
    table = pos.to(tl.int64)[:, None] * half + tl.where(first, d, d - half)[None, :]
    cos = tl.load(cos_ptr + table, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + table, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        w = tl.load(norm_w_ptr + d, mask=in_head, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(norm_w_ptr + partner, mask=in_head, other=0.0).to(tl.float32)[None, :]
    else:
        w = cos
        wp = cos
    return x, xp, cos, sin, w, wp


@triton.jit
def _normed_rotated(
    x, xp, cos, sin, w, wp, d, eps,
    HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr, NORM_OFFSET: tl.constexpr,
):  # fmt: skip
    """_rope_operands' rows after the per-head RMSNorm (QK_NORM; Gemma's (1 + w) with NORM_OFFSET)
    and the rotate-half rotation, in the heads' dtype: what engine.layers.fused's RoPE kernel
    computes, rounded where it rounds."""
    dtype = x.dtype
    if QK_NORM:  # Qwen3, Gemma 3: each head normalised over head_dim before the rotation
        f = x.to(tl.float32)
        fp = xp.to(tl.float32)
        rstd = (1.0 / tl.sqrt(tl.sum(f * f, axis=1) / HEAD_DIM + eps))[:, None]
        x = weighted_norm(f, rstd, w, NORM_OFFSET, dtype)
        xp = weighted_norm(fp, rstd, wp, NORM_OFFSET, dtype)
    # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), each product rounded as torch rounds it
    own = (x.to(tl.float32) * cos).to(dtype).to(tl.float32)
    other = (xp.to(tl.float32) * sin).to(dtype).to(tl.float32)
    return tl.where((d < HEAD_DIM // 2)[None, :], own - other, own + other).to(dtype)


@triton.jit
def _rotate_and_write(
    q_heads, row_valid, q_pos, d, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, eps,
    k_cache_ptr, v_cache_ptr, k_new_ptr, v_new_ptr, slot_ptr, token, kv_head, ctx_start, writes,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cs, stride_ch,
    HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr, NORM_OFFSET: tl.constexpr,
):  # fmt: skip
    """A decode program's q rows, normed and rotated; when it `writes` (it holds the sequence's
    last key) and the token has a slot (a negative one is padding), the token's K head (normed,
    rotated) and V head stored at the slot (a contiguous cache: slot * stride_cs addresses block
    and offset). Every load is issued before any arithmetic waits on one; a barrier at the end, so
    the program's own loads of that key see the stores. A decode token sits at its context's last
    position (ctx_start; padding, with no context: 0)."""
    qx, qxp, q_cos, q_sin, qw, qwp = _rope_operands(
        q_heads, row_valid, tl.maximum(q_pos, 0), d, cos_ptr, sin_ptr, q_norm_ptr, HEAD_DIM,
        QK_NORM,
    )  # fmt: skip
    slot = tl.load(slot_ptr + token).to(tl.int64)
    row = tl.arange(0, 2)  # a two-row tile (tiles have power-of-two rows): row 0 is the head
    one = (row < 1) & writes
    k_pos = tl.zeros([2], dtype=tl.int32) + tl.maximum(ctx_start, 0)
    kx, kxp, k_cos, k_sin, kw, kwp = _rope_operands(
        k_new_ptr + token * stride_knt + kv_head * stride_knh + row[:, None] * 0, one, k_pos, d,
        cos_ptr, sin_ptr, k_norm_ptr, HEAD_DIM, QK_NORM,
    )  # fmt: skip
    in_head = one[:, None] & (d < HEAD_DIM)[None, :]
    value_ptrs = v_new_ptr + token * stride_vnt + kv_head * stride_vnh + row[:, None] * 0
    value = tl.load(value_ptrs + d[None, :], mask=in_head, other=0.0)
    q = _normed_rotated(qx, qxp, q_cos, q_sin, qw, qwp, d, eps, HEAD_DIM, QK_NORM, NORM_OFFSET)
    key = _normed_rotated(kx, kxp, k_cos, k_sin, kw, kwp, d, eps, HEAD_DIM, QK_NORM, NORM_OFFSET)
    at = slot * stride_cs + kv_head * stride_ch + row[:, None] * 0 + d[None, :]
    stored = in_head & (slot >= 0)
    tl.store(k_cache_ptr + at, key.to(k_cache_ptr.dtype.element_ty), mask=stored)
    tl.store(v_cache_ptr + at, value.to(v_cache_ptr.dtype.element_ty), mask=stored)
    tl.debug_barrier()
    return q


# seq_offset and the block table's row stride (the step's table width) change from step to step:
# not specialized on (divisible by 16, equal to 1), so they never pick another compiled variant.
@triton.jit(do_not_specialize=["stride_bt", "seq_offset"])
def paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    arrivals_ptr,
    qsl_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,
    window,
    cap,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    seq_offset,
    cos_ptr,
    sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    k_new_ptr,
    v_new_ptr,
    slot_ptr,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    norm_eps,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    FP8: tl.constexpr,
    MIN_SPLIT_TILES: tl.constexpr,
    ROPE: tl.constexpr,
    QK_NORM: tl.constexpr,
    NORM_OFFSET: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (sequence b = seq_offset + its first index, kv head x split, query tile): rows are
    (query token, head of the group) pairs.

    Everything a program needs about its sequence comes from device tensors, so the grid depends on
    shapes only. With NUM_SPLITS > 1 it writes a normalised partial output and its log2-sum-exp.
    FUSED_MERGE: only the splits the context needs run; one that has the whole context writes the
    output itself, otherwise the last split to arrive (an atomic count per sequence and kv head,
    reset by it) merges the partials; a split takes at least MIN_SPLIT_TILES key tiles, so a short
    context is one split that stores its output with no merge. Without FUSED_MERGE every split
    writes a partial and merge_splits_kernel combines them. FP8: the cache holds FP8 K/V; q goes to
    fp16 (fp32 stays) and v_scale multiplies each (partial) output (the merge is linear in them).

    ROPE (decode, one query token per sequence, a cache in q's dtype): q, k_new and v_new come as
    the qkv projection left them. Every program rotates its q rows at the token's position (after
    the per-head norm with QK_NORM), and the program that holds the sequence's last key (its last
    split) stores the new token's rotated K and its V at slot_ptr's slot before it reads its keys:
    no RoPE launch, and no split reads that slot before it is written.
    """
    release(PDL)
    b = tl.program_id(0) + seq_offset
    kv_head = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    q0 = (
        tl.num_programs(2) - 1 - tl.program_id(2)
    ) * BLOCK_Q  # the longest (last) query tiles start first
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if q0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_start = seq_len - q_len  # position of the sequence's first query token

    # Keys this tile can see: [lo, hi); those below `full` are visible to every row (no mask
    # needed).
    hi = ctx_start + tl.minimum(q0 + BLOCK_Q, q_len)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx_start + q0 - window + 1, 0) // BLOCK_N * BLOCK_N
        full = lo  # every tile is masked under a window
    else:
        full = (ctx_start + q0 + 1) // BLOCK_N * BLOCK_N
    # splits that hold keys (at least one, so a row with no context still writes its zeros)
    num_active = 1
    if NUM_SPLITS > 1:
        tiles = tl.cdiv(hi - lo, BLOCK_N)
        per_split_tiles = tl.maximum(tl.cdiv(tiles, NUM_SPLITS), MIN_SPLIT_TILES)
        num_active = tl.maximum(tl.cdiv(tiles, per_split_tiles), 1)
        if FUSED_MERGE:
            if split >= num_active:
                return
        lo = lo + split * per_split_tiles * BLOCK_N
        hi = tl.minimum(hi, lo + per_split_tiles * BLOCK_N)

    rows = tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (tok < BLOCK_Q) & (q0 + tok < q_len)
    q_pos = ctx_start + q0 + tok
    token = (q_start + q0 + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    io_mask = row_valid[:, None] & d_mask[None, :]
    k_base = k_cache_ptr + kv_head * stride_ch
    v_base = v_cache_ptr + kv_head * stride_ch
    q_heads = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
    if ROPE:
        q = _rotate_and_write(
            q_heads, row_valid, q_pos, d, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, norm_eps,
            k_cache_ptr, v_cache_ptr, k_new_ptr, v_new_ptr, slot_ptr, q_start.to(tl.int64),
            kv_head, ctx_start, (lo < hi) & (hi == seq_len), stride_knt, stride_knh, stride_vnt,
            stride_vnh, stride_cs, stride_ch, HEAD_DIM, QK_NORM, NORM_OFFSET,
        )  # fmt: skip
    else:
        q = tl.load(q_heads + d[None, :], mask=io_mask, other=0.0)
    if not FP8:
        q = q.to(k_cache_ptr.dtype.element_ty)
    elif not IEEE:
        # bf16/fp16 q over an FP8 cache: the dots run in fp16, what FP8 widens to by moving bits;
        # q is clamped to fp16's range
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    table_row = block_tables_ptr + b.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    e5m2: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.float8e5
    if FP8:  # the cache in words of two values: halves of q and of the output (see _attend_tile)
        q, q_odd = tl.split(tl.reshape(q, [BLOCK_M, BLOCK_D // 2, 2]))
        acc = tl.zeros([BLOCK_M, BLOCK_D // 2], dtype=tl.float32)
        acc_odd = tl.zeros([BLOCK_M, BLOCK_D // 2], dtype=tl.float32)
        k_base = k_base.to(tl.pointer_type(tl.uint16))
        v_base = v_base.to(tl.pointer_type(tl.uint16))
        d = tl.arange(0, BLOCK_D // 2)
        d_mask = d < HEAD_DIM // 2
        stride_cb = stride_cb // 2
        stride_cs = stride_cs // 2
        if not e5m2:  # e4m3 widens to its value / E4M3_WIDEN (_widen_pairs)
            scale_log2 = scale_log2 * E4M3_WIDEN
            cap = cap / E4M3_WIDEN
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        q_odd = q  # not read
        acc_odd = acc  # not read
    for start in range(lo, tl.minimum(full, hi), BLOCK_N):
        acc, acc_odd, m_i, l_i = _attend_tile(
            acc, acc_odd, m_i, l_i, q, q_odd, start, hi, table_row, k_base, v_base, q_pos, d,
            d_mask, scale_log2, window, cap, stride_cb, stride_cs, PAGE, BLOCK_N,
            HEAD_DIM, BLOCK_D, False,
            USE_WINDOW, IEEE, SOFTCAP, FP8, e5m2,
        )  # fmt: skip
    for start in range(tl.maximum(full, lo), hi, BLOCK_N):
        acc, acc_odd, m_i, l_i = _attend_tile(
            acc, acc_odd, m_i, l_i, q, q_odd, start, hi, table_row, k_base, v_base, q_pos, d,
            d_mask, scale_log2, window, cap, stride_cb, stride_cs, PAGE, BLOCK_N,
            HEAD_DIM, BLOCK_D, True,
            USE_WINDOW, IEEE, SOFTCAP, FP8, e5m2,
        )  # fmt: skip
    if FP8:
        acc = tl.reshape(tl.join(acc, acc_odd), [BLOCK_M, BLOCK_D])
        d = tl.arange(0, BLOCK_D)
        if not e5m2:
            v_scale = v_scale * E4M3_WIDEN

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if FP8:
        out = out * v_scale
    dst = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    if NUM_SPLITS == 1:
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    elif FUSED_MERGE and num_active == 1:
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        first = (token * NUM_HEADS + head) * NUM_SPLITS  # this row's split 0
        tl.store(
            part_out_ptr + (first + split)[:, None] * BLOCK_D + d[None, :],
            out,
            mask=row_valid[:, None],
        )
        tl.store(part_lse_ptr + first + split, m_i + tl.log2(l_i), mask=row_valid)
        if FUSED_MERGE:
            # acq_rel: this split's partials are visible before its arrival counts; the last one
            # sees them all
            arrival = arrivals_ptr + b * (tl.num_programs(1) // NUM_SPLITS) + kv_head
            if tl.atomic_add(arrival, 1, sem="acq_rel") == num_active - 1:
                _merge_group(
                    out_ptr,
                    part_out_ptr,
                    part_lse_ptr,
                    (q_start + q0).to(tl.int64),
                    kv_head,
                    num_active,
                    stride_ot,
                    stride_oh,
                    NUM_HEADS,
                    GROUP,
                    HEAD_DIM,
                    BLOCK_D,
                    NUM_SPLITS,
                    BLOCK_S,
                )
                tl.atomic_xchg(arrival, 0)  # ready for the next launch (or CUDA-graph replay)


@triton.jit
def _merge_group(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    token,
    kv_head,
    num_active,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """For each head of the group, over the active splits:
    out = sum_s exp2(lse_s - max) * partial_s / sum_s exp2(lse_s - max)
    (heads unrolled, so all their loads are in flight together)."""
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_active
    for g in tl.static_range(GROUP):
        head = kv_head * GROUP + g
        first = (token * NUM_HEADS + head) * NUM_SPLITS
        lse = tl.load(
            part_lse_ptr + first + s, mask=s_ok, other=float("-inf"), cache_modifier=".cg"
        )
        partial = tl.load(
            part_out_ptr + (first + s)[:, None] * BLOCK_D + d[None, :],
            mask=s_ok[:, None],
            other=0.0,
            cache_modifier=".cg",
        )
        top = tl.max(lse, 0)
        weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
        total = tl.sum(weight, 0)
        out = tl.sum(partial * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
        tl.store(
            out_ptr + token * stride_ot + head * stride_oh + d,
            out.to(out_ptr.dtype.element_ty),
            mask=d < HEAD_DIM,
        )


@triton.jit
def merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (token, head): weight each split's output by exp2(its lse - max); no context
    gives zeros."""
    release(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    part = (t * NUM_HEADS + h) * NUM_SPLITS + s
    lse = tl.load(part_lse_ptr + part, mask=s < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(lse - top)
    partial = tl.load(
        part_out_ptr + part[:, None] * BLOCK_D + d[None, :],
        mask=(s < NUM_SPLITS)[:, None],
        other=0.0,
    )
    total = tl.sum(weight, 0)
    out = tl.sum(partial * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )
