"""The sparse MLP of mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE, Mixtral): a softmax top-k
router, experts stored stacked ([E, 2I, H] gate_up and [E, H, I] down, the fused kernel's layout),
and Qwen2-MoE's sigmoid-gated shared expert.

On CUDA the experts run as the Triton kernels of engine/layers/fused_moe.py (grouped GEMMs over the
tokens sorted by expert, or at decode batches one read of its expert per pick); the plain torch
path here (a loop over the experts that received tokens) is the CPU reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.layers.activation import silu_and_mul
from engine.layers.fused import fused_kernels_available
from engine.layers.linear import Linear

# "auto": the fused Triton kernels on CUDA, the torch loop elsewhere; "loop": always the torch loop
# (the benchmark's baseline; its host syncs keep it out of CUDA graphs).
EXPERTS_IMPL = "auto"


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


def experts_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = ids[t, j], one plain
    matmul pair per expert that received tokens, in expert order. x [T, H]; gate_up [E, 2I, H];
    down [E, H, I] -> [T, H] in x's dtype."""
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():  # ascending
        tokens, slots = torch.where(ids == expert)
        h = silu_and_mul(F.linear(x[tokens], gate_up[expert]))
        y = F.linear(h, down[expert]) * weights[tokens, slots, None].to(x.dtype)
        out.index_add_(0, tokens, y)
    return out


class StackedExperts(nn.Module):
    """The experts' weights, one tensor per projection: gate_up_proj [E, 2I, H] (gate rows first,
    then up) and down_proj [E, H, I]."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        empty = dict(dtype=dtype, device=device)
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * inter, hidden, **empty), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden, inter, **empty), requires_grad=False
        )

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if EXPERTS_IMPL == "auto" and fused_kernels_available(x):
            from engine.layers.fused_moe import fused_experts

            return fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids)
        return experts_reference(x, self.gate_up_proj, self.down_proj, weights, ids)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}"


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

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        moe = cfg.moe
        if moe is None:
            raise ValueError(f"{cfg.architecture} has no experts (ModelConfig.moe is None)")
        self.top_k = moe.top_k
        self.renormalise = moe.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, moe.num_experts, False, dtype, device)
        self.experts = StackedExperts(
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
        if EXPERTS_IMPL == "auto" and fused_kernels_available(logits):
            from engine.layers.fused_moe import route_topk

            return route_topk(logits, self.top_k, self.renormalise)
        return route_reference(logits, self.top_k, self.renormalise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert(x)
        return out
