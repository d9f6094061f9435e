"""What both fused MoE paths' kernels share (engine/layers/fused_moe.py's sorted path and
engine/layers/fused_moe_decode.py's decode path): the router's softmax and top-k computed inside a
program, and float32 results rounded through the activation dtype where torch's ops round, so both
paths and the torch reference agree.
"""

from __future__ import annotations

try:  # a CPU-only install may have no triton; the torch reference never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None


def routing_slots(top_k: int) -> int:
    """softmax_topk's K_P2 for top_k: the power of two at or above it, at least 2 (tl.topk's
    least)."""
    return max(2, triton.next_power_of_2(top_k))


if triton is not None:

    @triton.jit
    def rounded(x, dtype: tl.constexpr):
        """float32 x rounded through `dtype` (the activation dtype), as a torch op's output is."""
        return x.to(dtype).to(tl.float32)

    @triton.jit
    def silu_and_mul_rounded(gate_acc, up_acc, dtype: tl.constexpr):
        """silu(gate) * up of float32 accumulators, each rounded through `dtype` first, as the
        torch path rounds its gate_up output."""
        gate = rounded(gate_acc, dtype)
        up = rounded(up_acc, dtype)
        return gate / (1.0 + tl.exp(-gate)) * up

    @triton.jit
    def softmax_topk(
        logits_ptr, row, num_experts, stride_lm,
        TOP_K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr, RENORMALISE: tl.constexpr,
    ):  # fmt: skip
        """(weights [K_P2] float32, expert ids [K_P2] int32) of token `row`: the float32 softmax
        of its router logits, its TOP_K largest in descending order (ties: the lower expert id),
        divided by their sum when RENORMALISE; slots past TOP_K hold 0. K_P2 >= 2 (tl.topk's
        least).

        One bitonic top-k (tl.topk) of packed keys: each logit's bits made order-preserving as an
        integer, above 16 bits of 0xFFFF - expert id, so a larger logit comes first and, among
        equal ones, the lower id. Both the sorted path's routing kernel and, in every program, the
        routed gate_up kernel run it; where it replaced a comparison of every pair of experts, a
        batch-1 decode step of Qwen3-30B-A3B took 0.2 ms less (bench/results/
        2026-11-28-h100-moe-topk)."""
        experts = tl.arange(0, E_P2)
        real = experts < num_experts
        x = tl.load(logits_ptr + row * stride_lm + experts, mask=real, other=float("-inf"))
        width: tl.constexpr = x.dtype.primitive_bitwidth  # 16 (bf16, fp16) or 32
        sign: tl.constexpr = 1 << (width - 1)
        ones: tl.constexpr = (1 << width) - 1
        if width == 16:
            bits = x.to(tl.int16, bitcast=True).to(tl.int64) & ones
        else:
            bits = x.to(tl.int32, bitcast=True).to(tl.int64) & ones
        # negative floats: every bit flipped; the others: the sign bit set
        ordered = tl.where((bits & sign) != 0, bits ^ ones, bits | sign)
        top = tl.topk((ordered << 16) | (0xFFFF - experts).to(tl.int64), K_P2)
        slots = tl.arange(0, K_P2)
        kept = slots < TOP_K
        chosen = tl.where(kept, 0xFFFF - (top & 0xFFFF), 0).to(tl.int32)
        top_ordered = top >> 16
        top_bits = tl.where((top_ordered & sign) != 0, top_ordered ^ sign, top_ordered ^ ones)
        if width == 16:
            top_x = top_bits.to(tl.int16).to(x.dtype, bitcast=True).to(tl.float32)
        else:
            top_x = top_bits.to(tl.int32).to(x.dtype, bitcast=True).to(tl.float32)
        high = tl.max(top_x, axis=0)
        p = tl.where(kept, tl.exp(top_x - high), 0.0)
        if RENORMALISE:
            total = tl.sum(p, axis=0)
        else:
            total = tl.sum(tl.where(real, tl.exp(x.to(tl.float32) - high), 0.0), axis=0)
        return p / total, chosen
