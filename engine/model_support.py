"""Which checkpoints the engine runs, decided from an HF config.json alone (no torch, no weights).

The cache asks it before a single weight is downloaded and ModelConfig asks it at load: one answer
for both.
"""

from __future__ import annotations

from typing import Any

from engine.checkpoint_quant import checkpoint_quantization
from engine.family_configs import gemma3_rope_settings, hidden_activation, language_model_config
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
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its text decoder; the vision tower is not loaded
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# MLP gate activations the engine runs, per family ("gelu" is the exact, erf one)
SUPPORTED_ACTIVATIONS = {
    family: ("gelu_pytorch_tanh", "gelu") if family.startswith("gemma") else ("silu",)
    for family in SUPPORTED_ARCHITECTURES.values()
}
# Older spellings transformers still reads as longrope (Phi-3's first 128k checkpoints say "su").
_ROPE_TYPE_ALIASES = {"su": "longrope"}
# Gemma settings the engine does not implement, and the value it runs (Gemma 2 soft-caps its
# attention scores and logits; Gemma 3 does neither).
_GEMMA_FIXED = {
    "gemma2": {"attention_bias": False},
    "gemma3": {
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "attention_bias": False,
    },
}


def rope_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rope settings of either spelling, `rope_parameters` (transformers 5) over `rope_scaling`
    (before), with "rope_type" set; ValueError for a rope type the engine does not implement."""
    merged = {**dict(cfg.get("rope_scaling") or {}), **dict(cfg.get("rope_parameters") or {})}
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    rope_type = _ROPE_TYPE_ALIASES.get(rope_type, rope_type)
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
    cfg = language_model_config(cfg)
    checkpoint_quantization(cfg)  # a quantization_config it can't serve raises, naming it
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
    if family in ("qwen2_moe", "qwen3_moe") and cfg.get("use_sliding_window", False):
        raise ValueError(
            f"use_sliding_window: per-layer sliding windows of {arch} are not supported"
        )
    if family in _GEMMA_FIXED:
        _check_gemma(cfg, arch, _GEMMA_FIXED[family])
    if family == "gemma3":
        for settings in gemma3_rope_settings(cfg):
            rope_settings({"rope_parameters": settings})
    else:
        rope_settings(cfg)
    activation = hidden_activation(cfg, family)
    if activation not in SUPPORTED_ACTIVATIONS[family]:
        field = "hidden_activation" if family.startswith("gemma") else "hidden_act"
        supported = ", ".join(SUPPORTED_ACTIVATIONS[family])
        raise ValueError(
            f"{field}: {arch} with {activation!r} is not supported: supported are {supported}"
        )
    read_moe_config(cfg, family)  # the expert fields (engine/moe_config.py)
    return arch, family


def _check_gemma(cfg: dict[str, Any], arch: str, fixed: dict[str, Any]) -> None:
    """Refuse the Gemma settings the engine does not implement, naming the field."""
    for field, runs in fixed.items():
        value = cfg.get(field, runs)
        if value != runs and not (runs is False and value is None):
            raise ValueError(f"{field}: {arch} with {field}={value!r} is not supported")
