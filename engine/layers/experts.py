"""The experts of a mixture-of-experts layer: their weights stacked as the fused kernels read them
([E, 2I, H] gate_up, gate rows first, and [E, H, I] down) and what they compute for routed tokens.

On CUDA the experts run as the Triton kernels of engine/layers/fused_moe.py (grouped GEMMs over the
tokens sorted by expert, or at decode batches one read of its expert per pick); the plain torch
loop here (over the experts that received tokens) is the CPU reference. A quantization scheme
brings its own experts class with this layout and per-row scales (engine.quant.fp8's FP8 experts),
which both paths take. The router and the layer around them: engine/layers/moe.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.activation import silu_and_mul
from engine.layers.fused import fused_kernels_available

# "auto": the fused Triton kernels on CUDA, the torch loop elsewhere; "loop": always the torch loop
# (the benchmark's baseline; its host syncs keep it out of CUDA graphs).
EXPERTS_IMPL = "auto"


def experts_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = ids[t, j], one plain
    matmul pair per expert that received tokens, in expert order. x [T, H]; gate_up [E, 2I, H];
    down [E, H, I] -> [T, H] in x's dtype. scales: FP8 experts' per-row scales ([E, 2I], [E, H]),
    each expert dequantized to x's dtype as it is used."""

    def weight(stacked: torch.Tensor, which: int, expert: int) -> torch.Tensor:
        if scales is None:
            return stacked[expert]
        return (stacked[expert].float() * scales[which][expert, :, None]).to(x.dtype)

    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():  # ascending
        tokens, slots = torch.where(ids == expert)
        h = silu_and_mul(F.linear(x[tokens], weight(gate_up, 0, expert)))
        y = F.linear(h, weight(down, 1, expert)) * weights[tokens, slots, None].to(x.dtype)
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
        """The experts on x: the fused kernels on CUDA, else the torch reference."""
        scales = self.expert_scales()
        if EXPERTS_IMPL == "auto" and fused_kernels_available(x):
            from engine.layers.fused_moe import fused_experts

            gate_up_scale, down_scale = scales or (None, None)
            return fused_experts(
                x, self.gate_up_proj, self.down_proj, weights, ids, None, gate_up_scale, down_scale
            )
        return experts_reference(x, self.gate_up_proj, self.down_proj, weights, ids, scales)

    def routed(self, x: torch.Tensor, routing, top_k: int, norm_after=None):
        """The experts on x routed inside their first kernel from routing
        (engine.layers.fused_moe_decode.InKernelRouting): CUDA, decode batches only. norm_after
        (a fused_moe_decode.NormAfter, one token): their down kernel begins that norm, and its
        NormAfterRow is returned instead."""
        from engine.layers.fused_moe_decode import routed_experts

        gate_up_scale, down_scale = self.expert_scales() or (None, None)
        return routed_experts(
            x,
            self.gate_up_proj,
            self.down_proj,
            routing,
            top_k,
            gate_up_scale,
            down_scale,
            norm_after=norm_after,
        )

    def expert_scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """FP8 weights' per-row scales (engine.quant.fp8.Fp8StackedExperts); None here."""
        return None

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}"
