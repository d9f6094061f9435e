"""The fused MoE's decode path (up to DECODE_MAX_TOKENS tokens; engine/layers/fused_moe.py takes
it from fused_experts): no sort and no reduction, two launches. gate_up: a program per (pair,
column tile) reads the pair's expert straight from the router's ids. down: a program per (token,
column tile) reads the tiles of all the token's top_k experts at once, sums their weighted
products in float32 and writes the token's output row. Each pick reads its expert on its own: an
expert picked by several tokens of the batch is read once per pick.

Routed in the kernel (routed_experts, what the decoder's decode steps take): the gate_up kernel
takes the router's logits instead of ids, each program finding its pair's expert itself (the
top-k has no launch of its own), and optionally the RMSNorm before the block (x then is the
residual stream, normed inside the products as engine.layers.row_gemv norms its input): with the
norm inside the router's one-row kernel too, a batch-1 sparse MLP is three launches (router,
gate_up, down) where it was five.

Routed and rounded as the sorted path (engine/layers/moe_kernel_math.py, which both paths' kernels
share).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.layers.moe_kernel_math import routing_slots
from engine.pdl import launch_options, release

try:  # a CPU-only install may have no triton; the torch reference never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None

# Up to this many tokens fused_experts takes the decode path. It saves the sort's and the sum's
# launches (fixed costs, large beside a decode step's few experts) and the sorted path's padding
# rows: up to 16 tokens an expert's sorted block (16 rows, the smallest) is mostly padding. It
# pays a read of the expert per pick (tokens sharing an expert re-read it, mostly from L2: the
# programs of one weight tile run side by side) and multiply-adds on CUDA cores per pick, which
# grow with the batch while the sorted blocks fill: the two paths break even near 8 tokens on an
# H200 (bench/moe_decode.py's sweep; bench/results/2026-11-26-h200-moe-decode-path).
DECODE_MAX_TOKENS = 8


class GemvTile(NamedTuple):
    """Tile of one decode-path kernel: BLOCK_N weight rows (output columns) by BLOCK_K, per pick,
    and its num_warps. No num_stages: Triton (3.6) software-pipelines only loads that feed a
    tl.dot, so a step's loads are in flight together only within a program; the bytes in flight
    per SM come from the tile's size and the programs an SM holds at once."""

    block_n: int
    block_k: int
    num_warps: int


class DecodeTiles(NamedTuple):
    """Tiles of the decode path's two launches: gate_up (per pair) and down (per token, BLOCK_N
    rows of each of its top_k experts at once)."""

    gate_up: GemvTile
    down: GemvTile


if triton is not None:
    from engine.layers.moe_kernel_math import rounded, silu_and_mul_rounded, softmax_topk
    from engine.layers.row_gemv import begin_norm_rows

    @triton.jit
    def _decode_gate_up_kernel(
        x_ptr,
        w_ptr,
        ws_ptr,
        h_ptr,
        ids_ptr,
        route_ptr,
        logits_ptr,
        g_ptr,
        sq_ptr,
        N,
        K,
        num_experts,
        n_sq,
        stride_xm,
        stride_we,
        stride_wn,
        stride_se,
        stride_hm,
        stride_lm,
        eps,
        TOP_K: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        ROUTE: tl.constexpr,
        NORM: tl.constexpr,
        NORMED: tl.constexpr,
        SQ_P2: tl.constexpr,
        E_P2: tl.constexpr,
        RENORMALISE: tl.constexpr,
        K_P2: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Program (p, n): h[p, n * BLOCK_N : +BLOCK_N] = silu(gate) * up of pair p (token
        p // TOP_K, flat index token * TOP_K + slot) through expert ids[p]; W is [E, 2N, K] (gate
        rows, then up rows). One A row: products on CUDA cores, summed over K at the end.
        HAS_SCALE: W is float8_e4m3fn with one fp32 scale per (expert, row) at ws_ptr.

        ROUTE: the pair's expert comes from the token's router logits (softmax_topk, computed by
        every program: no launch of its own), and the programs of column tile 0 write ids[p] and
        its router weight route[p] for the down kernel. NORM: x is the stream before the RMSNorm
        of weight g: the products take g * x and are divided by the row's rms at the end (the
        norm's 1/rms factors out of the dot product, as in engine.layers.row_gemv). NORMED: x is
        a one-row NormedRow's scaled row (g * x already) and sq_ptr its n_sq sums of squares: the
        products are divided by the rms those give."""
        release(PDL)
        pair = tl.program_id(0)
        pid_n = tl.program_id(1)
        token = pair // TOP_K
        if ROUTE:
            weights, chosen = softmax_topk(
                logits_ptr, token, num_experts, stride_lm, TOP_K, K_P2, E_P2, RENORMALISE
            )
            mine = tl.arange(0, K_P2) == pair % TOP_K
            picked = tl.sum(tl.where(mine, chosen, 0), axis=0)
            weight = tl.sum(tl.where(mine, weights, 0.0), axis=0)
        if ROUTE:
            if pid_n == 0:
                tl.store(ids_ptr + pair, picked)
                tl.store(route_ptr + pair, weight)
            expert = picked.to(tl.int64)
        else:
            expert = tl.load(ids_ptr + pair).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rn_safe = tl.where(rn < N, rn, 0)  # out-of-range rows re-read row 0 (stores masked)
        rk = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + token.to(tl.int64) * stride_xm + rk
        g_ptrs = g_ptr + rk
        w_ptrs = (
            w_ptr + expert * stride_we + rn_safe.to(tl.int64)[:, None] * stride_wn + rk[None, :]
        )
        up_offset = N * stride_wn
        # [BLOCK_N, BLOCK_K] partial sums: one reduction across threads after the loop, not per step
        gate_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        up_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + rk) < K
            if EVEN_K:
                a = tl.load(x_ptrs)
                w_gate = tl.load(w_ptrs)
                w_up = tl.load(w_ptrs + up_offset)
            else:
                a = tl.load(x_ptrs, mask=k_ok, other=0.0)
                w_gate = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                w_up = tl.load(w_ptrs + up_offset, mask=k_ok[None, :], other=0.0)
            a = a.to(tl.float32)
            if NORM:
                squares += a * a
                a = a * tl.load(g_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            gate_acc += w_gate.to(tl.float32) * a[None, :]
            up_acc += w_up.to(tl.float32) * a[None, :]
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        dtype = h_ptr.dtype.element_ty
        gate = tl.sum(gate_acc, axis=1)
        up = tl.sum(up_acc, axis=1)
        if NORM or NORMED:
            if NORMED:
                sq_offs = tl.arange(0, SQ_P2)
                squares = tl.load(sq_ptr + sq_offs, mask=sq_offs < n_sq, other=0.0)
            inv_rms = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
            gate = gate * inv_rms
            up = up * inv_rms
        if HAS_SCALE:
            scales = ws_ptr + expert * stride_se + rn_safe
            gate = gate * tl.load(scales)
            up = up * tl.load(scales + N)
        h = silu_and_mul_rounded(gate, up, dtype)
        tl.store(h_ptr + pair.to(tl.int64) * stride_hm + rn, h.to(dtype), mask=rn < N)

    @triton.jit
    def _decode_down_kernel(
        h_ptr,
        w_ptr,
        ws_ptr,
        out_ptr,
        ids_ptr,
        route_weights_ptr,
        res_ptr,
        g_ptr,
        summed_ptr,
        sq_ptr,
        N,
        K,
        stride_hm,
        stride_we,
        stride_wn,
        stride_se,
        stride_om,
        TOP_K: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        K_P2: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        NORM_AFTER: tl.constexpr,
        OFFSET: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Program (t, n): out[t, n * BLOCK_N : +BLOCK_N] = the sum over token t's TOP_K slots j
        of route[t, j] * (h[t * TOP_K + j] @ W[ids[t, j]]^T), W [E, N, K]. Each step loads the
        [TOP_K, BLOCK_N, BLOCK_K] tiles of all the token's experts: one loop over K keeps every
        expert's bytes in flight together (a loop per slot would wait on each expert in turn).

        Rounded as the sorted path rounds: each slot's product through the activation dtype, times
        its route weight rounded the same way, the result rounded again (the sorted path stores
        it), the slots summed in float32 and rounded once. HAS_SCALE: W is float8_e4m3fn with one
        fp32 scale per (expert, row) at ws_ptr.

        NORM_AFTER (one token) begins the next RMSNorm, as engine.layers.row_gemv's EPILOGUE NORM
        does: s = out + residual (res_ptr) goes to summed_ptr, g * s (OFFSET: (1 + g) * s) to
        out_ptr, and the program's sum of s^2 to sq_ptr[n]."""
        release(PDL)
        token = tl.program_id(0)
        pid_n = tl.program_id(1)
        slots = tl.arange(0, K_P2)
        slot_ok = slots < TOP_K
        pairs = token.to(tl.int64) * TOP_K + slots
        experts = tl.load(ids_ptr + pairs, mask=slot_ok, other=0).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rn_safe = tl.where(rn < N, rn, 0)  # out-of-range rows re-read row 0 (stores masked)
        rk = tl.arange(0, BLOCK_K)
        h_ptrs = h_ptr + pairs[:, None] * stride_hm + rk[None, :]
        w_ptrs = (
            w_ptr
            + experts[:, None, None] * stride_we
            + rn_safe.to(tl.int64)[None, :, None] * stride_wn
            + rk[None, None, :]
        )
        acc = tl.zeros([K_P2, BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                h_ok = slot_ok[:, None]
            else:
                h_ok = slot_ok[:, None] & ((k0 + rk) < K)[None, :]
            h = tl.load(h_ptrs, mask=h_ok, other=0.0)
            w = tl.load(w_ptrs, mask=h_ok[:, None, :], other=0.0)
            acc += w.to(tl.float32) * h.to(tl.float32)[:, None, :]
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        dtype = out_ptr.dtype.element_ty
        products = tl.sum(acc, axis=2)
        if HAS_SCALE:
            scales = ws_ptr + experts[:, None] * stride_se + rn_safe.to(tl.int64)[None, :]
            products = products * tl.load(scales, mask=slot_ok[:, None], other=0.0)
        route = rounded(tl.load(route_weights_ptr + pairs, mask=slot_ok, other=0.0), dtype)
        weighted = rounded(rounded(products, dtype) * route[:, None], dtype)
        total = tl.sum(weighted, axis=0).to(dtype)
        if NORM_AFTER:
            residual = tl.load(res_ptr + rn_safe)
            g = tl.load(g_ptr + rn_safe).to(tl.float32)
            if OFFSET:
                g = 1.0 + g
            summed, squares, total = begin_norm_rows(total, residual, g, rn < N)
            tl.store(summed_ptr + rn, summed, mask=rn < N)
            tl.store(sq_ptr + pid_n, squares)
        tl.store(out_ptr + token.to(tl.int64) * stride_om + rn, total, mask=rn < N)


def uses_decode_path(num_tokens: int) -> bool:
    """Whether fused_experts, left to choose, takes the decode path for this many tokens."""
    return num_tokens <= DECODE_MAX_TOKENS


def decode_tiles(top_k: int) -> DecodeTiles:
    """The decode path's tiles. gate_up: 16 rows of gate and 16 of up, 256 deep (16 KiB of bf16 in
    flight per program, 64 float32 partial sums per thread of 4 warps), so batch 1 launches
    top_k * I / 16 programs, a few per SM even for a narrow expert. down: BLOCK_N rows of each of
    the token's experts at once, 128 deep, BLOCK_N shrinking as top_k grows (2 at top-8: the
    sweep's best at batches 1 to 16), so batch 1 launches H / BLOCK_N programs."""
    rows_per_slot = max(1, 16 // triton.next_power_of_2(top_k))
    return DecodeTiles(GemvTile(16, 256, 4), GemvTile(rows_per_slot, 128, 4))


def block_k_for(block_k: int, k: int) -> int:
    """A tile's BLOCK_K, cut down to the reduction's length (at least 16) when that is shorter."""
    return min(block_k, max(16, triton.next_power_of_2(k)))


class InKernelRouting(NamedTuple):
    """What the decode path's gate_up kernel routes from itself (routed_experts): the router's
    logits [T, E], whether its top-k renormalise, and the RMSNorm (weight [H], eps) it applies to
    x first (None: x comes normed). With `squares`, x is one row begun by the linear before
    (engine.layers.fused_linears.NormedRow: its scaled row, and these sums of squares): the kernel
    finishes the norm (the weight is in x already; eps is the norm's)."""

    logits: torch.Tensor
    renormalise: bool
    norm: tuple[torch.Tensor, float] | None
    squares: torch.Tensor | None = None


class NormAfter(NamedTuple):
    """The RMSNorm after the experts, begun by the down kernel of a one-token decode step: the
    residual stream the experts' output is added to, the norm's weight, and whether it scales by
    (1 + w) (Gemma's)."""

    residual: torch.Tensor
    weight: torch.Tensor
    offset: bool = False


class NormAfterRow(NamedTuple):
    """What the down kernel wrote under NormAfter: `scaled` = w * (out + residual), `summed` =
    out + residual, `squares` each program's sum of (out + residual)^2 (a NormedRow's parts)."""

    scaled: torch.Tensor
    summed: torch.Tensor
    squares: torch.Tensor


def routed_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    routing: InKernelRouting,
    top_k: int,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    tiles: DecodeTiles | None = None,
    norm_after: NormAfter | None = None,
) -> torch.Tensor | NormAfterRow:
    """The decode path (up to DECODE_MAX_TOKENS tokens) routed inside its gate_up kernel: what
    fused_experts(norm(x), ..., *route_topk(logits)) computes, in two launches instead of three
    (four with the norm). Weights and scales as fused_experts takes them. norm_after (one token):
    the down kernel begins the next norm on the output and returns its NormAfterRow."""
    t = x.shape[0]
    if not 0 < t <= DECODE_MAX_TOKENS:
        raise ValueError(
            f"routed_experts: {t} tokens; the decode path takes 1 to {DECODE_MAX_TOKENS}"
        )
    if (norm_after is not None or routing.squares is not None) and t != 1:
        raise ValueError(f"routed_experts: a norm split over the kernels takes 1 token, not {t}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    logits = routing.logits if routing.logits.stride(-1) == 1 else routing.logits.contiguous()
    flat_ids = torch.empty(t * top_k, dtype=torch.int32, device=x.device)
    route = torch.empty(t * top_k, dtype=torch.float32, device=x.device)
    routing = routing._replace(logits=logits)
    scales = (gate_up_scale, down_scale)
    return decode_experts(
        x,
        gate_up,
        down,
        route,
        flat_ids,
        top_k,
        tiles or decode_tiles(top_k),
        scales,
        routing,
        norm_after,
    )


def decode_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    route: torch.Tensor,
    flat_ids: torch.Tensor,
    top_k: int,
    tiles: DecodeTiles,
    scales: tuple[torch.Tensor | None, torch.Tensor | None],
    routing: InKernelRouting | None = None,
    norm_after: NormAfter | None = None,
) -> torch.Tensor | NormAfterRow:
    """The decode path: h [T * k, I] = silu(gate) * up of every (token, slot) pair, then each
    token's weighted sum over its k experts' down projections, written straight to out [T, H].
    routing: the gate_up kernel writes flat_ids and route itself (routed_experts). norm_after:
    the down kernel begins that norm (one token) and the NormAfterRow is returned instead."""
    t, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    h = torch.empty((t * top_k, inter), dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    tile = tiles.gate_up
    block_k = block_k_for(tile.block_k, hidden)
    gate_up_scale, down_scale = scales
    logits = routing.logits if routing is not None else x
    norm_weight, eps = (routing.norm if routing is not None else None) or (x, 0.0)
    squares = routing.squares if routing is not None else None
    normed = squares is not None
    _decode_gate_up_kernel[(t * top_k, triton.cdiv(inter, tile.block_n))](
        x,
        gate_up,
        gate_up_scale if gate_up_scale is not None else x,
        h,
        flat_ids,
        route,
        logits,
        norm_weight,
        squares if normed else route,
        inter,
        hidden,
        num_experts,
        squares.numel() if normed else 0,
        x.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        gate_up_scale.stride(0) if gate_up_scale is not None else 0,
        h.stride(0),
        logits.stride(0),
        eps,
        TOP_K=top_k,
        HAS_SCALE=gate_up_scale is not None,
        BLOCK_N=tile.block_n,
        BLOCK_K=block_k,
        EVEN_K=hidden % block_k == 0,
        ROUTE=routing is not None,
        NORM=routing is not None and routing.norm is not None and not normed,
        NORMED=normed,
        SQ_P2=triton.next_power_of_2(squares.numel()) if normed else 1,
        E_P2=triton.next_power_of_2(num_experts),
        RENORMALISE=routing is not None and routing.renormalise,
        K_P2=routing_slots(top_k),
        num_warps=tile.num_warps,
        **launch_options(),
    )
    tile = tiles.down
    block_k = block_k_for(tile.block_k, inter)
    programs = triton.cdiv(hidden, tile.block_n)
    if norm_after is not None:
        summed = torch.empty_like(x)
        out_squares = torch.empty(programs, dtype=torch.float32, device=x.device)
        residual, next_weight = norm_after.residual, norm_after.weight
    else:  # unused pointers
        summed, out_squares, residual, next_weight = out, route, out, out
    _decode_down_kernel[(t, programs)](
        h,
        down,
        down_scale if down_scale is not None else h,
        out,
        flat_ids,
        route,
        residual,
        next_weight,
        summed,
        out_squares,
        hidden,
        inter,
        h.stride(0),
        down.stride(0),
        down.stride(1),
        down_scale.stride(0) if down_scale is not None else 0,
        out.stride(0),
        TOP_K=top_k,
        HAS_SCALE=down_scale is not None,
        K_P2=triton.next_power_of_2(top_k),
        BLOCK_N=tile.block_n,
        BLOCK_K=block_k,
        EVEN_K=inter % block_k == 0,
        NORM_AFTER=norm_after is not None,
        OFFSET=norm_after is not None and norm_after.offset,
        num_warps=tile.num_warps,
        **launch_options(),
    )
    if norm_after is not None:
        return NormAfterRow(out, summed, out_squares)
    return out
