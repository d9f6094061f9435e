"""Fused mixture-of-experts in Triton for CUDA: the router's softmax top-k, then the experts by one
of two paths, both reading only the experts the tokens picked and neither reading back to the host
(buffers sized from the token count alone), so decode steps capture into CUDA graphs.

Sorted path (more than DECODE_MAX_TOKENS tokens): the (token, slot) pairs are sorted by
expert into blocks of BLOCK_M rows, each expert's group padded to a whole block; one grouped GEMM
launch for every expert's gate_up (SiLU-and-mul fused) and one for down (the router weight fused),
a program per (block, column tile) reading its block's expert once for all the block's rows on
tensor cores. The top_k weighted rows of each token are then summed by one torch reduction.

Decode path (up to DECODE_MAX_TOKENS tokens): engine/layers/fused_moe_decode.py, no sort and no
reduction, two launches; there also the decode path routed inside its gate_up kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.layers.fused_moe_decode import (
    DecodeTiles,
    block_k_for,
    decode_experts,
    decode_tiles,
    uses_decode_path,
)
from engine.layers.moe_kernel_math import routing_slots
from engine.pdl import launch_options, release

try:  # a CPU-only install may have no triton; the torch reference never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
else:  # the routing and rounding both paths' kernels share
    from engine.layers.moe_kernel_math import rounded, silu_and_mul_rounded, softmax_topk


# The largest BLOCK_M moe_tiles picks: the sorted rows' padding is at most BLOCK_M - 1 per expert.
MAX_BLOCK_M = 64
# Up to this many (token, slot) pairs the sort by expert is one Triton program (decode batches);
# more go through torch's sort.
ONE_PROGRAM_PAIRS = 512


class MoeTiles(NamedTuple):
    """Tiles of one fused MoE call: BLOCK_M rows per sorted block (shared by both GEMMs), and
    (BLOCK_N, BLOCK_K) of the gate_up and down GEMMs; num_warps, num_stages of both."""

    block_m: int
    gate_up: tuple[int, int]
    down: tuple[int, int]
    num_warps: int
    num_stages: int


if triton is not None:

    @triton.jit
    def _route_topk_kernel(
        logits_ptr,
        weights_ptr,
        ids_ptr,
        num_experts,
        stride_lm,
        TOP_K: tl.constexpr,
        K_P2: tl.constexpr,
        E_P2: tl.constexpr,
        RENORMALISE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Program t: token t's router weights and expert ids (softmax_topk)."""
        release(PDL)
        row = tl.program_id(0)
        values, chosen = softmax_topk(
            logits_ptr, row, num_experts, stride_lm, TOP_K, K_P2, E_P2, RENORMALISE
        )
        slots = tl.arange(0, K_P2)
        keep = slots < TOP_K
        tl.store(weights_ptr + row * TOP_K + slots, values, mask=keep)
        tl.store(ids_ptr + row * TOP_K + slots, chosen, mask=keep)

    @triton.jit
    def _moe_align_kernel(
        ids_ptr,
        sorted_ptr,
        block_expert_ptr,
        num_pairs,
        num_blocks,
        BLOCK_M: tl.constexpr,
        E_P2: tl.constexpr,
        CHUNK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One program sorts the num_pairs (token, slot) pairs of ids_ptr (flat [T * top_k] expert
        ids) by expert: sorted_ptr receives each pair's flat index, expert e's group starting at a
        multiple of BLOCK_M and padded to one with num_pairs; block_expert_ptr receives the expert
        of each block, E_P2 (or more) for blocks past the last group."""
        release(PDL)
        experts = tl.arange(0, E_P2)
        counts = tl.zeros([E_P2], dtype=tl.int32)
        for first in range(0, num_pairs, CHUNK):
            offs = first + tl.arange(0, CHUNK)
            ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=E_P2)
            counts += tl.sum((ids[None, :] == experts[:, None]).to(tl.int32), axis=1)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        starts = ends - padded
        # each group's padding rows hold num_pairs (no pair)
        pad = starts[:, None] + counts[:, None] + tl.arange(0, BLOCK_M)[None, :]
        filler = tl.zeros([E_P2, BLOCK_M], dtype=tl.int32) + num_pairs
        tl.store(sorted_ptr + pad, filler, mask=pad < ends[:, None])
        placed = tl.zeros([E_P2], dtype=tl.int32)
        for first in range(0, num_pairs, CHUNK):
            offs = first + tl.arange(0, CHUNK)
            ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=E_P2)
            hit = (ids[None, :] == experts[:, None]).to(tl.int32)
            rank = tl.cumsum(hit, axis=1) - 1  # among this chunk's pairs of the same expert
            dest = tl.sum(hit * ((starts + placed)[:, None] + rank), axis=0)
            tl.store(sorted_ptr + dest, offs, mask=offs < num_pairs)
            placed += tl.sum(hit, axis=1)
        for first in range(0, num_blocks, CHUNK):
            blocks = first + tl.arange(0, CHUNK)
            before = (ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32)
            tl.store(block_expert_ptr + blocks, tl.sum(before, axis=1), mask=blocks < num_blocks)

    @triton.jit
    def _moe_gemm_kernel(
        a_ptr,
        w_ptr,
        ws_ptr,
        c_ptr,
        sorted_ptr,
        block_expert_ptr,
        route_weights_ptr,
        num_pairs,
        N,
        K,
        num_experts,
        stride_am,
        stride_we,
        stride_wn,
        stride_se,
        stride_cm,
        TOP_K: tl.constexpr,
        GATE_UP: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        IEEE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Program (b, n): columns [n * BLOCK_N, +BLOCK_N) of sorted block b, through its expert's
        weights only.

        GATE_UP: A rows are tokens (pair // TOP_K), W is [E, 2N, K] (gate rows, then up rows), the
        output is silu(gate) * up at the block's sorted rows. Otherwise (down): A rows are the
        sorted rows, W is [E, N, K], the output is scaled by the pair's router weight and lands at
        the pair's row (flat index token * TOP_K + slot). HAS_SCALE: W is float8_e4m3fn, widened
        to A's dtype for the dot, with one fp32 scale per (expert, output row) at ws_ptr applied to
        the accumulators."""
        release(PDL)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert >= num_experts:
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(sorted_ptr + rows)
        real = pairs < num_pairs
        if GATE_UP:
            a_rows = tl.where(real, pairs // TOP_K, 0)
            c_rows = rows
        else:
            a_rows = rows
            c_rows = tl.where(real, pairs, 0)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rn_safe = tl.where(rn < N, rn, 0)  # out-of-range columns re-read row 0 (stores masked)
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + rk[None, :]
        w_ptrs = (
            w_ptr
            + expert.to(tl.int64) * stride_we
            + rn_safe.to(tl.int64)[:, None] * stride_wn
            + rk[None, :]
        )
        up_offset = N * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + rk) < K
            if EVEN_K:
                a = tl.load(a_ptrs, mask=real[:, None], other=0.0)
                w = tl.load(w_ptrs)
            else:
                a = tl.load(a_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            if HAS_SCALE:
                w = w.to(a_ptr.dtype.element_ty)
            if IEEE:
                acc += tl.dot(a, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(a, tl.trans(w))
            if GATE_UP:
                if EVEN_K:
                    w_up = tl.load(w_ptrs + up_offset)
                else:
                    w_up = tl.load(w_ptrs + up_offset, mask=k_ok[None, :], other=0.0)
                if HAS_SCALE:
                    w_up = w_up.to(a_ptr.dtype.element_ty)
                if IEEE:
                    acc_up += tl.dot(a, tl.trans(w_up), input_precision="ieee")
                else:
                    acc_up += tl.dot(a, tl.trans(w_up))
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_SCALE:
            scales = ws_ptr + expert.to(tl.int64) * stride_se + rn_safe
            acc = acc * tl.load(scales)[None, :]
            if GATE_UP:
                acc_up = acc_up * tl.load(scales + N)[None, :]
        if GATE_UP:
            acc = silu_and_mul_rounded(acc, acc_up, c_ptr.dtype.element_ty)
        else:
            route = tl.load(route_weights_ptr + tl.where(real, pairs, 0), mask=real, other=0.0)
            route = rounded(route, c_ptr.dtype.element_ty)
            acc = rounded(acc, c_ptr.dtype.element_ty) * route[:, None]
        c_ptrs = c_ptr + c_rows.to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=real[:, None] & (rn < N)[None, :])


def moe_tiles(num_tokens: int, num_experts: int, top_k: int) -> MoeTiles:
    """Tiles by the expected rows per expert: decode (a few rows per expert) takes BLOCK_M 16 and
    narrow, deep weight tiles, so many programs stream the few selected experts at bandwidth;
    prefill takes tensor-core tiles."""
    rows_per_expert = num_tokens * top_k / max(num_experts, 1)
    if rows_per_expert <= 16:
        return MoeTiles(16, (32, 256), (32, 256), 4, 3)
    if rows_per_expert <= 64:
        return MoeTiles(32, (64, 64), (64, 64), 4, 3)
    return MoeTiles(MAX_BLOCK_M, (64, 64), (128, 64), 4, 3)


def route_topk(
    router_logits: torch.Tensor, top_k: int, renormalise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] router logits -> (weights [T, top_k] float32, expert ids [T, top_k] int32), as
    engine.layers.moe.route_reference computes them, in one launch."""
    t, e = router_logits.shape
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    if t:
        _route_topk_kernel[(t,)](
            logits,
            weights,
            ids,
            e,
            logits.stride(0),
            TOP_K=top_k,
            K_P2=routing_slots(top_k),
            E_P2=triton.next_power_of_2(e),
            RENORMALISE=renormalise,
            **launch_options(),
        )
    return weights, ids


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int, one_program: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat expert ids [P] (P = tokens * top_k) int32 -> (sorted pair indices [capacity] int32,
    padded with P; the expert of each BLOCK_M block [capacity / block_m] int32, >= num_experts for
    unused blocks). The capacity, P + min(E, P) * (block_m - 1) rounded up to a block, bounds any
    routing, so nothing is read back to the host.

    one_program (default: P <= ONE_PROGRAM_PAIRS): one Triton launch, serial over P (decode);
    otherwise a few torch ops (a stable argsort) that scale with P."""
    pairs = ids.numel()
    capacity = -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m) * block_m
    if one_program is None:
        one_program = pairs <= ONE_PROGRAM_PAIRS
    if not one_program:
        return _align_with_torch(ids, num_experts, block_m, capacity)
    sorted_pairs = torch.empty(capacity, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=ids.device)
    e_p2 = triton.next_power_of_2(num_experts)
    _moe_align_kernel[(1,)](
        ids,
        sorted_pairs,
        block_expert,
        pairs,
        capacity // block_m,
        BLOCK_M=block_m,
        E_P2=e_p2,
        CHUNK=max(16, min(triton.next_power_of_2(max(pairs, capacity // block_m)), 8192 // e_p2)),
        num_warps=4,
        **launch_options(),
    )
    return sorted_pairs, block_expert


def _align_with_torch(
    ids: torch.Tensor, num_experts: int, block_m: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """align_by_expert in torch ops, none of which reads back to the host."""
    pairs, device = ids.numel(), ids.device
    longs = ids.long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, longs, torch.ones_like(longs))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(longs, stable=True)
    expert_of = longs[order]
    rank = torch.arange(pairs, device=device) - (counts.cumsum(0) - counts)[expert_of]
    sorted_pairs = torch.full((capacity,), pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, (ends - padded)[expert_of] + rank, order.to(torch.int32))
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)
    return sorted_pairs, block_expert


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    tiles: MoeTiles | DecodeTiles | None = None,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; router weights [T, k] float32 and expert ids
    [T, k] -> [T, H] in x's dtype: what engine.layers.experts.experts_reference computes. FP8
    experts: gate_up and down float8_e4m3fn with fp32 scales [E, 2I] and [E, H] (one per output
    row; the weights widen to x's dtype in the kernels, the scales apply to the fp32 sums). Up to
    DECODE_MAX_TOKENS tokens by the decode path (two launches), beyond by the sorted path (sort,
    gate_up, down, and a sum over k). `tiles` overrides the choice of path (MoeTiles: sorted,
    DecodeTiles: decode) and of tiles: the benchmark and tests sweep them."""
    t = x.shape[0]
    if t == 0:
        return torch.empty_like(x)
    if gate_up.stride(-1) != 1 or down.stride(-1) != 1:
        raise ValueError("fused_experts: expert weights must be contiguous along their last dim")
    x = x if x.stride(-1) == 1 else x.contiguous()
    flat_ids = ids.reshape(-1).to(torch.int32).contiguous()
    route = weights.reshape(-1).to(torch.float32).contiguous()
    top_k = ids.shape[1]
    if tiles is None:
        decode = uses_decode_path(t)
        tiles = decode_tiles(top_k) if decode else moe_tiles(t, gate_up.shape[0], top_k)
    scales = (gate_up_scale, down_scale)
    if (gate_up_scale is None) != (down_scale is None):
        raise ValueError("fused_experts: FP8 experts need both gate_up_scale and down_scale")
    if isinstance(tiles, DecodeTiles):
        return decode_experts(x, gate_up, down, route, flat_ids, top_k, tiles, scales)
    return _sorted_experts(x, gate_up, down, route, flat_ids, top_k, tiles, scales)


def _sorted_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    route: torch.Tensor,
    flat_ids: torch.Tensor,
    top_k: int,
    tiles: MoeTiles,
    scales: tuple[torch.Tensor | None, torch.Tensor | None],
) -> torch.Tensor:
    """The sorted path: the pairs sorted by expert, both grouped GEMMs over the sorted blocks, and
    a torch sum over each token's k weighted rows."""
    t, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    sorted_pairs, block_expert = align_by_expert(flat_ids, num_experts, tiles.block_m)
    num_blocks = block_expert.numel()
    h = torch.empty((sorted_pairs.numel(), inter), dtype=x.dtype, device=x.device)
    out = torch.empty((t * top_k, hidden), dtype=x.dtype, device=x.device)
    for a, w, ws, c, n, k, (block_n, block_k), first in (
        (x, gate_up, scales[0], h, inter, hidden, tiles.gate_up, True),
        (h, down, scales[1], out, hidden, inter, tiles.down, False),
    ):
        block_k = block_k_for(block_k, k)
        _moe_gemm_kernel[(num_blocks, triton.cdiv(n, block_n))](
            a,
            w,
            ws if ws is not None else a,
            c,
            sorted_pairs,
            block_expert,
            route,
            t * top_k,
            n,
            k,
            num_experts,
            a.stride(0),
            w.stride(0),
            w.stride(1),
            ws.stride(0) if ws is not None else 0,
            c.stride(0),
            TOP_K=top_k,
            GATE_UP=first,
            HAS_SCALE=ws is not None,
            BLOCK_M=tiles.block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            EVEN_K=k % block_k == 0,
            IEEE=x.dtype == torch.float32,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
            **launch_options(),
        )
    if top_k == 1:
        return out
    return out.view(t, top_k, hidden).sum(dim=1)
