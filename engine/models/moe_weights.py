"""HF tensor names of a sparse MoE layer and the rows of our stacked parameters each one fills.

Hub checkpoints (and transformers' save_pretrained) store one tensor per expert and projection:
Qwen MoE `mlp.experts.E.{gate,up,down}_proj.weight`, Mixtral `block_sparse_moe.experts.E.w1/w3/w2`
(gate, up, down); the engine stacks them as experts.gate_up_proj [E, 2I, H] (expert e's gate rows
at e*2I, its up rows at e*2I + I) and experts.down_proj [E, H, I] (rows e*H).
"""

from __future__ import annotations

from collections.abc import Iterator

from engine.config import ModelConfig

# family -> (HF module of the sparse MLP, names of its (gate, up, down) projections per expert)
_HF_NAMES = {
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}


def expert_projection_names(family: str) -> tuple[str, str, str] | None:
    """The per-expert (gate, up, down) projection names of a family's checkpoints; None for a
    family without experts."""
    names = _HF_NAMES.get(family)
    return names[1] if names is not None else None


def moe_weight_rows(cfg: ModelConfig, layer: int) -> Iterator[tuple[str, str, int, int]]:
    """(HF tensor name, our parameter, first row, row count) of every tensor of layer `layer`'s
    sparse MLP, rows counted in our parameter flattened to 2-D; nothing for a dense layer."""
    moe = cfg.moe
    if moe is None or not moe.is_sparse(layer):
        return
    module, (gate, up, down) = _HF_NAMES[cfg.family]
    hf, ours = f"model.layers.{layer}.{module}", f"layers.{layer}.mlp"
    inter, hidden = moe.expert_intermediate_size, cfg.hidden_size
    yield f"{hf}.gate.weight", f"{ours}.gate.weight", 0, moe.num_experts
    for e in range(moe.num_experts):
        expert = f"{hf}.experts.{e}"
        yield f"{expert}.{gate}.weight", f"{ours}.experts.gate_up_proj", 2 * e * inter, inter
        yield f"{expert}.{up}.weight", f"{ours}.experts.gate_up_proj", (2 * e + 1) * inter, inter
        yield f"{expert}.{down}.weight", f"{ours}.experts.down_proj", e * hidden, hidden
    shared = moe.shared_expert_intermediate_size
    if shared:
        fused = f"{ours}.shared_expert.gate_up_proj.weight"
        yield f"{hf}.shared_expert.gate_proj.weight", fused, 0, shared
        yield f"{hf}.shared_expert.up_proj.weight", fused, shared, shared
        down_ours = f"{ours}.shared_expert.down_proj.weight"
        yield f"{hf}.shared_expert.down_proj.weight", down_ours, 0, hidden
        yield f"{hf}.shared_expert_gate.weight", f"{ours}.shared_expert_gate.weight", 0, 1
