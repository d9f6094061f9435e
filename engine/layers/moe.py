"""The sparse MLP of mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE, Mixtral): a softmax top-k
router (the Triton kernel of engine/layers/fused_moe.py on CUDA, route_reference elsewhere), the
experts (engine/layers/experts.py, or a quantization scheme's), and Qwen2-MoE's sigmoid-gated
shared expert.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers import experts as experts_layer
from engine.layers.activation import silu_and_mul
from engine.layers.experts import StackedExperts
from engine.layers.fused import fused_kernels_available
from engine.layers.fused_linears import NormedRow, begins_norm, norm_linear, one_row_norm_linear
from engine.layers.fused_moe_decode import InKernelRouting, NormAfter
from engine.layers.linear import Linear
from engine.layers.norm import OffsetRMSNorm, RMSNorm

# Decode batches route inside the experts' first kernel (SparseMoeBlock.norm_forward); benchmarks
# turn it off to compare.
ROUTE_IN_KERNEL = True
# At one-row decode the norms around the experts are split over the kernels beside them, as
# engine.layers.fused_linears splits them at dense layers: the experts' down kernel begins the next
# layer's input norm (NORM_AFTER), and o_proj begins the post-attention norm, which the router's
# kernel and the experts' gate_up kernel finish (NORMED_INPUT). Benchmarks turn them off to compare.
NORM_AFTER = True
NORMED_INPUT = True


def route_reference(
    router_logits: torch.Tensor, top_k: int, renormalise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] router logits -> (weights [T, top_k] float32, expert ids [T, top_k] int64): the
    top_k of the float32 softmax, divided by their sum when `renormalise`."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a dense SiLU-gated MLP every token goes through."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * inter, False, dtype, device)
        self.down_proj = Linear(inter, hidden, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """x -> sum of the top-k experts' outputs weighted by the router (+ the gated shared expert).

    Parameters: gate (the router, [E, H]), experts.gate_up_proj, experts.down_proj, and with a
    shared expert shared_expert.{gate_up,down}_proj and shared_expert_gate ([1, H]).
    """

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device, experts: type[nn.Module] | None = None
    ) -> None:
        """experts: the experts' class (a quantization scheme's, engine.quant.QuantConfig.experts);
        StackedExperts by default."""
        super().__init__()
        moe = cfg.moe
        if moe is None:
            raise ValueError(f"{cfg.architecture} has no experts (ModelConfig.moe is None)")
        self.top_k = moe.top_k
        self.renormalise = moe.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, moe.num_experts, False, dtype, device)
        self.experts = (experts or StackedExperts)(
            moe.num_experts, cfg.hidden_size, moe.expert_intermediate_size, dtype, device
        )
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = (
            SharedExpert(cfg.hidden_size, shared, dtype, device) if shared else None
        )
        self.shared_expert_gate = (
            Linear(cfg.hidden_size, 1, False, dtype, device) if shared else None
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] float32, expert ids [T, top_k]) of each token."""
        logits = self.gate(x)
        if experts_layer.EXPERTS_IMPL == "auto" and fused_kernels_available(logits):
            from engine.layers.fused_moe import route_topk

            return route_topk(logits, self.top_k, self.renormalise)
        return route_reference(logits, self.top_k, self.renormalise)

    def norm_forward(
        self,
        norm: RMSNorm,
        x: torch.Tensor | NormedRow,
        residual: torch.Tensor | None,
        next_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor | NormedRow, torch.Tensor | None]:
        """(self(norm(x + residual)), x + residual). At decode batches on CUDA (no shared expert)
        the router's top-k runs inside the experts' first kernel, and for one row the norm runs
        inside the router's kernel and the experts' (engine.layers.fused_linears,
        engine.layers.fused_moe_decode.routed_experts): two to four launches fewer. x may be a
        NormedRow of `norm` (residual None), begun by o_proj (takes_normed_row). With next_norm,
        for one row, the experts' down kernel begins that norm on the output and this returns
        (NormedRow, None), the sum inside."""
        if isinstance(x, NormedRow):
            if not self.routes_in_kernel(x.scaled):
                return self(x.finish()), x.summed
            logits, stream = norm_linear(norm, self.gate, x, None)
            routing = InKernelRouting(logits, self.renormalise, (norm.weight, norm.eps), x.squares)
            return self._experts(x.scaled, routing, stream, next_norm)
        if not self.routes_in_kernel(x):
            h, residual = norm(x, residual)
            return self(h), residual
        fused = one_row_norm_linear(norm, self.gate, x, residual) if type(norm) is RMSNorm else None
        if fused is None:
            h, residual = norm(x, residual)
            routing = InKernelRouting(self.gate(h), self.renormalise, None)
            return self._experts(h, routing, residual, next_norm)
        logits, residual = fused
        routing = InKernelRouting(logits, self.renormalise, (norm.weight, norm.eps))
        return self._experts(residual, routing, residual, next_norm)

    def _experts(self, x: torch.Tensor, routing, stream: torch.Tensor, next_norm):
        """(the experts' output, stream), routed in their kernel; for one row with next_norm,
        (NormedRow of next_norm(output + stream), None): their down kernel begins that norm."""
        if not (NORM_AFTER and x.shape[0] == 1 and begins_norm(next_norm)):
            return self.experts.routed(x, routing, self.top_k), stream
        after = NormAfter(stream, next_norm.weight, isinstance(next_norm, OffsetRMSNorm))
        row = self.experts.routed(x, routing, self.top_k, after)
        return NormedRow(row.scaled, row.squares, row.summed, next_norm), None

    def takes_normed_row(self, x: torch.Tensor) -> bool:
        """Whether norm_forward finishes a NormedRow of the one row x in its own kernels (else it
        would finish the norm in torch first): the decoder then has o_proj begin the norm."""
        return NORMED_INPUT and x.shape[0] == 1 and self.routes_in_kernel(x)

    def routes_in_kernel(self, x: torch.Tensor) -> bool:
        """Whether the tokens of x are routed inside the experts' first kernel (norm_forward)."""
        if not (ROUTE_IN_KERNEL and self.shared_expert is None):
            return False
        if experts_layer.EXPERTS_IMPL != "auto" or not fused_kernels_available(x):
            return False
        from engine.layers.fused_moe_decode import uses_decode_path

        return uses_decode_path(x.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert(x)
        return out
