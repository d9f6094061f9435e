"""What a checkpoint's `quantization_config` says about its weights, read before any weight moves:
the FP8 formats the engine loads, and one refusal naming the field for everything else.

Two formats are read, as their tools write them: compressed-tensors' "float-quantized" FP8
(llm-compressor; RedHatAI and neuralmagic checkpoints) with per-tensor, per-channel or block weight
scales, and transformers' "fp8" (FineGrainedFP8Config; Qwen3-*-FP8 and DeepSeek checkpoints) with
block scales. No torch here: the pre-download check runs on config.json alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SUPPORTED = (
    "FP8 checkpoints: compressed-tensors float-quantized (8-bit float weights per tensor, per "
    "channel or in blocks; dynamic or static activations) or quant_method fp8 with "
    "weight_block_size"
)
# Modules a checkpoint may leave unquantized that the engine keeps in high precision anyway (a
# mixture of experts' router and shared-expert gate among them).
_KEPT_HIGH = re.compile(
    r"(lm_head|embed|vision|visual|multi_modal|mm_projector|router"
    r"|(mlp|block_sparse_moe)\.gate$|shared_expert_gate$)"
)


@dataclass(frozen=True)
class CheckpointFp8:
    """An FP8 checkpoint's weight format: which tool wrote it, the scale granularity of its weights
    ("tensor", "channel" or "block"), the block shape, and how it quantized activations."""

    method: str  # "compressed-tensors" | "fp8"
    weight_scales: str
    block: tuple[int, int] | None
    activations: str  # "dynamic" | "static"
    scale_name: str  # the tensor beside each FP8 weight that dequantizes it


def checkpoint_quantization(cfg: dict[str, Any]) -> CheckpointFp8 | None:
    """The FP8 format of a config.json's quantization_config (None when it has none); ValueError
    naming the field and the supported formats for anything else."""
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise ValueError(f"quantization_config: must be an object, got {type(quant).__name__}")
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    if method == "fp8":
        return _hf_fp8(quant)
    raise ValueError(
        f"quantization_config.quant_method: {method!r} checkpoints are not supported; "
        f"supported are {SUPPORTED}, or the unquantized model"
    )


def _refuse(field: str, value: Any, what: str) -> ValueError:
    return ValueError(
        f"quantization_config.{field}: {value!r} ({what}) is not supported; supported are "
        f"{SUPPORTED}"
    )


def _compressed_tensors(quant: dict) -> CheckpointFp8:
    fmt = quant.get("format")
    if fmt != "float-quantized":
        raise _refuse("format", fmt, "compressed-tensors format")
    if quant.get("kv_cache_scheme"):
        raise ValueError(
            "quantization_config.kv_cache_scheme: checkpoints with KV-cache scales are not "
            "supported; load the checkpoint without them, or set KV_CACHE_DTYPE"
        )
    if quant.get("sparsity_config"):
        raise _refuse("sparsity_config", "set", "sparse weights")
    _check_ignored("ignore", quant.get("ignore") or [])
    groups = quant.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse("config_groups", sorted(groups), "one group quantizing every Linear")
    ((name, group),) = groups.items()
    field = f"config_groups.{name}"
    if group.get("targets") != ["Linear"]:
        raise _refuse(f"{field}.targets", group.get("targets"), "targets other than Linear")
    weights = group.get("weights") or {}
    if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
        what = f"{weights.get('type')} {weights.get('num_bits')}-bit weights"
        raise _refuse(f"{field}.weights", what, "not 8-bit float")
    if weights.get("dynamic") or not weights.get("symmetric", True):
        raise _refuse(f"{field}.weights", "dynamic or asymmetric", "weight scales")
    strategy = weights.get("strategy")
    block = None
    if strategy == "block":
        block = _block(f"{field}.weights.block_structure", weights.get("block_structure"))
    elif strategy not in ("tensor", "channel"):
        raise _refuse(f"{field}.weights.strategy", strategy, "weight scale granularity")
    acts = group.get("input_activations")
    if acts is not None and (acts.get("type"), acts.get("num_bits")) != ("float", 8):
        raise _refuse(f"{field}.input_activations", acts.get("num_bits"), "not 8-bit float")
    if group.get("output_activations"):
        raise _refuse(f"{field}.output_activations", "set", "quantized outputs")
    return CheckpointFp8(
        method="compressed-tensors",
        weight_scales=strategy,
        block=block,
        activations="static" if acts is not None and not acts.get("dynamic") else "dynamic",
        scale_name="weight_scale",
    )


def _hf_fp8(quant: dict) -> CheckpointFp8:
    _check_ignored("modules_to_not_convert", quant.get("modules_to_not_convert") or [])
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse("activation_scheme", quant.get("activation_scheme"), "fp8 activations")
    if quant.get("dequantize"):
        raise _refuse("dequantize", True, "a checkpoint meant to be dequantized on load")
    block = quant.get("weight_block_size")
    return CheckpointFp8(
        method="fp8",
        weight_scales="block" if block else "tensor",
        block=_block("weight_block_size", block) if block else None,
        activations="dynamic",
        scale_name="weight_scale_inv",
    )


def _block(field: str, value: Any) -> tuple[int, int]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and v > 0 for v in value)
    ):
        raise ValueError(
            f"quantization_config.{field}: expected two positive integers, got {value!r}"
        )
    return (value[0], value[1])


def _check_ignored(field: str, names: list) -> None:
    """The engine quantizes every attention and MLP linear: a checkpoint that keeps one of them in
    high precision is refused rather than quantized against its author's choice."""
    # a name, or a regular expression as llm-compressor writes them ("re:.*mlp.gate$")
    kept = [n for n in names if not _KEPT_HIGH.search(str(n).removeprefix("re:").removesuffix("$"))]
    if kept:
        raise ValueError(
            f"quantization_config.{field}: this checkpoint keeps {kept[:3]} unquantized; the "
            "engine quantizes every attention and MLP linear, so it can't serve it as written"
        )
