"""The mixture-of-experts fields of an HF config.json (Qwen3-MoE, Qwen2-MoE, Mixtral), read and
checked without torch: how many experts, how many each token takes, their width, the shared expert,
and which layers keep a dense MLP.

engine.model_support asks it before any weight is downloaded; ModelConfig keeps its answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")

# transformers' defaults for a field a config.json leaves out (configuration_<family>.py)
_DEFAULTS = {
    "qwen2_moe": dict(
        num_experts=60,
        num_experts_per_tok=4,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        norm_topk_prob=False,
        decoder_sparse_step=1,
    ),
    "qwen3_moe": dict(
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=False,
        decoder_sparse_step=1,
    ),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
}


@dataclass(frozen=True)
class MoeConfig:
    """The sparse MLP of a family: softmax over `num_experts` router logits, the `top_k` largest
    kept (renormalised to sum to 1 when norm_topk_prob), each expert a SiLU-gated MLP of width
    `expert_intermediate_size`; plus, when shared_expert_intermediate_size > 0, a shared expert of
    that width scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE). The layers in dense_layers use
    the model's dense MLP (intermediate_size) instead."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int
    dense_layers: tuple[int, ...]

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


def read_moe_config(cfg: dict[str, Any], family: str) -> MoeConfig | None:
    """The MoeConfig of a config.json of `family` (None for a dense family); ValueError naming the
    field the engine cannot run."""
    if family not in MOE_FAMILIES:
        return None
    defaults = _DEFAULTS[family]

    def field(name: str) -> Any:
        value = cfg.get(name)
        return defaults.get(name) if value is None else value

    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act: {act!r} experts are not supported: supported is 'silu'")
    num_layers = _int("num_hidden_layers", cfg.get("num_hidden_layers"), 1)
    windowed = [t for t in cfg.get("layer_types") or [] if t != "full_attention"]
    if family != "mixtral" and windowed:  # Qwen MoE: per-layer windows, as use_sliding_window
        raise ValueError(
            f"layer_types: {windowed[0]!r} layers of {family} are not supported: "
            "supported is 'full_attention'"
        )
    if family == "mixtral":
        num_experts = _int("num_local_experts", field("num_local_experts"), 1)
        width = _int("intermediate_size", cfg.get("intermediate_size"), 1)
        renormalise, shared, dense = True, 0, ()
    else:  # Qwen MoE; transformers 5 writes num_experts as num_local_experts
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        num_experts = _int(
            "num_experts", defaults["num_experts"] if experts is None else experts, 0
        )
        width = _int("moe_intermediate_size", field("moe_intermediate_size"), 1)
        renormalise = bool(field("norm_topk_prob"))
        shared = 0
        if family == "qwen2_moe":
            shared = _int(
                "shared_expert_intermediate_size", field("shared_expert_intermediate_size"), 0
            )
        dense = _dense_layers(cfg, num_layers, num_experts, field("decoder_sparse_step"))
    top_k = _int("num_experts_per_tok", field("num_experts_per_tok"), 1)
    if len(dense) < num_layers and top_k > num_experts:
        raise ValueError(
            f"num_experts_per_tok: {top_k} is more than the model's {num_experts} experts"
        )
    return MoeConfig(num_experts, top_k, width, renormalise, shared, dense)


def _dense_layers(
    cfg: dict[str, Any], num_layers: int, num_experts: int, sparse_step: Any
) -> tuple[int, ...]:
    """Qwen MoE: a layer is dense when listed in mlp_only_layers, when (layer + 1) is not a multiple
    of decoder_sparse_step, or when the model has no experts (as transformers builds its layers)."""
    step = _int("decoder_sparse_step", sparse_step, 1)
    listed = cfg.get("mlp_only_layers") or []
    if not isinstance(listed, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in listed
    ):
        raise ValueError(f"mlp_only_layers: must be a list of layer indices, got {listed!r}")
    outside = [i for i in listed if not 0 <= i < num_layers]
    if outside:
        raise ValueError(
            f"mlp_only_layers: layers {outside} are not in the model's {num_layers} layers"
        )
    return tuple(
        i for i in range(num_layers) if i in listed or num_experts == 0 or (i + 1) % step != 0
    )


def _int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")
    return value
