"""Which checkpoints the engine runs, decided from an HF config.json alone (no torch, no weights).

The cache asks it before a single weight is downloaded and ModelConfig asks it at load: one answer
for both.
"""

from __future__ import annotations

from typing import Any

from engine.moe_config import read_moe_config

# HF architecture name -> family switch of the one decoder template (engine/models/decoder.py).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_WEIGHTS = "unquantized float32, bfloat16 or float16 weights"


def rope_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rope settings of either spelling, `rope_parameters` (transformers 5) over `rope_scaling`
    (before), with "rope_type" set; ValueError for a rope type the engine does not implement."""
    merged = {**dict(cfg.get("rope_scaling") or {}), **dict(cfg.get("rope_parameters") or {})}
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported: "
            f"supported are {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return {**merged, "rope_type": rope_type}


def check_model_config(cfg: dict[str, Any]) -> tuple[str, str]:
    """(architecture, family) of a config.json the engine can run; otherwise ValueError naming the
    field and what is supported."""
    if not isinstance(cfg, dict):
        raise ValueError(f"config.json: must be a JSON object, got {type(cfg).__name__}")
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ValueError(
            f"quantization_config: quantized checkpoints ({method!r}) are not "
            f"supported: supported are {SUPPORTED_WEIGHTS}"
        )
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}: "
            f"supported are {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    if cfg.get("mlp_bias"):
        raise ValueError(f"mlp_bias: {arch} checkpoints with MLP biases are not supported")
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and cfg.get(
        "use_sliding_window", False
    ):
        # HF windows only the layers past max_window_layers
        raise ValueError(
            f"use_sliding_window: per-layer sliding windows of {arch} are not supported"
        )
    rope_settings(cfg)
    read_moe_config(cfg, family)  # the expert fields (engine/moe_config.py)
    return arch, family
