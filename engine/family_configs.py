"""Config.json details of the families beyond the Llama template's fields: a multimodal checkpoint's
nested text config, Gemma's defaults and Gemma 3's per-layer rope, Phi-3's longrope, per-layer
windows.

Plain dict arithmetic, no torch: engine.model_support asks it before a weight is downloaded and
ModelConfig at load, so both read a config.json the same way.
"""

from __future__ import annotations

from typing import Any

# Checkpoints that wrap a text decoder with a vision tower: their decoder's fields sit under
# `text_config`; the engine runs the text decoder alone.
MULTIMODAL_WRAPPERS = ("Gemma3ForConditionalGeneration",)

# What transformers' Gemma3TextConfig assumes for a field the file leaves out (the published
# Gemma 3 configs omit most of them).
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}
# Gemma2Config's defaults, likewise.
GEMMA2_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 2,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
}
# Fields of the wrapper's top level that hold for its text decoder too (over the text config's own:
# its token ids are the chat model's, e.g. Gemma 3's eos [1, 106], end_of_turn included).
_WRAPPER_FIELDS = (
    "architectures",
    "eos_token_id",
    "bos_token_id",
    "torch_dtype",
    "dtype",
    "quantization_config",
)

# Gemma's (and Qwen's) two kinds of layer, as transformers names them in `layer_types`.
SLIDING, FULL = "sliding_attention", "full_attention"
# Families whose layers come in those two kinds (the others window every layer alike).
_INTERLEAVED = ("gemma2", "gemma3", "qwen2", "qwen3")
# rope keys that may sit at the top level of a config instead of inside its rope settings
_TOP_LEVEL_ROPE_KEYS = ("original_max_position_embeddings", "partial_rotary_factor")


def language_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config of the decoder the engine runs: a multimodal wrapper's `text_config` (with the
    wrapper's architectures, token ids, dtype and quantization), Gemma's defaults filled in."""
    archs = cfg.get("architectures") or []
    text = cfg
    if any(a in MULTIMODAL_WRAPPERS for a in archs):
        nested = cfg.get("text_config")
        if not isinstance(nested, dict):
            raise ValueError(f"text_config: {archs[0]} checkpoints need a text_config object")
        text = {**nested, **{k: cfg[k] for k in _WRAPPER_FIELDS if cfg.get(k) is not None}}
    if any(a.startswith("Gemma3") for a in archs):
        text = {**GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
    if any(a.startswith("Gemma2") for a in archs):  # a null soft-cap stays null: it turns it off
        text = {**GEMMA2_DEFAULTS, **text}
    return text


def hidden_activation(cfg: dict[str, Any], family: str) -> str:
    """The MLP's gate activation, as transformers names it (Gemma's field is hidden_activation)."""
    if family.startswith("gemma"):
        return cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    return cfg.get("hidden_act") or "silu"


def layer_kinds(cfg: dict[str, Any], family: str, num_layers: int) -> list[str]:
    """SLIDING or FULL for every layer: `layer_types` when the config lists them, else Gemma's
    `sliding_window_pattern` (every n-th layer global), else Qwen's `max_window_layers` (the layers
    from there on windowed) when `use_sliding_window`; otherwise all FULL."""
    kinds = cfg.get("layer_types")
    if kinds:
        if len(kinds) != num_layers or any(k not in (SLIDING, FULL) for k in kinds):
            raise ValueError(
                f"layer_types: expected {num_layers} entries of {SLIDING!r} or {FULL!r}, "
                f"got {kinds!r}"
            )
        return list(kinds)
    if family.startswith("gemma"):  # Gemma 2 alternates (pattern 2), Gemma 3 has 5 local to 1
        default = 6 if family == "gemma3" else 2
        pattern = int(
            cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or default
        )
        return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if family in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        first = int(cfg.get("max_window_layers", 28))
        return [SLIDING if i >= first else FULL for i in range(num_layers)]
    return [FULL] * num_layers


def local_layers(cfg: dict[str, Any], family: str, num_layers: int) -> tuple[int, ...]:
    """The indices of the SLIDING layers of a model that interleaves two kinds (Gemma, Qwen with
    use_sliding_window); () for the others (Mistral windows every layer alike)."""
    if family not in _INTERLEAVED:
        return ()
    return tuple(
        i for i, kind in enumerate(layer_kinds(cfg, family, num_layers)) if kind == SLIDING
    )


def layer_windows(
    local: tuple[int, ...], family: str, num_layers: int, window: int | None
) -> tuple[int | None, ...]:
    """Each layer's window: `window` on the local layers of an interleaved model, on every layer
    of the others."""
    if family not in _INTERLEAVED:
        return (window,) * num_layers
    return tuple(window if i in local else None for i in range(num_layers))


def gemma3_rope_settings(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global layers' rope settings, local layers'): `rope_parameters` keyed by layer kind
    (transformers 5), or before that `rope_scaling` + `rope_theta` for the global layers and
    `rope_local_base_freq` for the local ones."""
    params = cfg.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full = dict(params.get(FULL) or {})
        local = dict(params.get(SLIDING) or {})
    else:
        full = {**dict(cfg.get("rope_scaling") or {}), **params}
        local = {}
    full.setdefault("rope_theta", cfg.get("rope_theta") or GEMMA3_TEXT_DEFAULTS["rope_theta"])
    local.setdefault(
        "rope_theta",
        cfg.get("rope_local_base_freq") or GEMMA3_TEXT_DEFAULTS["rope_local_base_freq"],
    )
    return full, local


def with_top_level_rope_keys(cfg: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """Rope settings completed with the keys Phi-3 keeps at the top level of its config
    (`original_max_position_embeddings`, `partial_rotary_factor`)."""
    extra = {k: cfg[k] for k in _TOP_LEVEL_ROPE_KEYS if cfg.get(k) is not None}
    return {**extra, **settings}
