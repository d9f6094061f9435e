"""Quantization schemes behind one small interface: a plain config object chosen from
EngineArgs.quantization (later also from a checkpoint's quantization_config) that builds the
quantized linears the model code asks for, loads their weights and checks the device.

The model code declares which linears are quantized (attention qkv/o, MLP gate_up/down: see
engine/models/decoder.py); the scheme owns the weight layout, the scales and the kernels. This
module imports no kernels, so engine.config can validate names cheaply; quant_config() imports the
scheme.
"""

from __future__ import annotations

from engine.quant.base import QuantConfig

# EngineArgs.quantization values the engine runs (None: the checkpoint's own dtype)
SUPPORTED_QUANTIZATION = ("fp8",)
# vLLM names of checkpoint formats: here the checkpoint's quantization_config says them itself
CHECKPOINT_FORMATS = ("compressed-tensors",)
# worker-vllm users send these: refused by name, with the supported list
KNOWN_UNSUPPORTED = (
    "awq",
    "awq_marlin",
    "gptq",
    "gptq_marlin",
    "bitsandbytes",
    "gguf",
    "marlin",
    "squeezellm",
    "fbgemm_fp8",
    "modelopt",
    "experts_int8",
)


def check_quantization(name: str | None) -> None:
    """Raise ValueError unless `name` is None or a supported scheme."""
    if name is None or name in SUPPORTED_QUANTIZATION:
        return
    supported = ", ".join(SUPPORTED_QUANTIZATION)
    if isinstance(name, str) and name.lower() in CHECKPOINT_FORMATS:
        raise ValueError(
            f"quantization: {name!r} is read from the checkpoint's quantization_config, not set: "
            "leave it unset for an FP8 checkpoint (set fp8 to quantize a bf16/fp16 one)"
        )
    if isinstance(name, str) and name.lower() in KNOWN_UNSUPPORTED:
        raise ValueError(
            f"quantization: {name!r} is not supported; supported: {supported} (FP8 weights and "
            "activations from a bf16/fp16 checkpoint), or unset to serve the checkpoint's dtype"
        )
    raise ValueError(f"quantization: must be one of {supported} or unset, got {name!r}")


def model_quantization(requested: str | None, model_config) -> str | None:
    """The scheme a model runs: `requested` (EngineArgs.quantization), or "fp8" for an FP8
    checkpoint (its quantization_config, engine/checkpoint_quant.py), whose weights load
    dequantized and quantized again by the scheme."""
    check_quantization(requested)
    if getattr(model_config, "checkpoint_fp8", None) is None or requested == "fp8":
        return requested
    return "fp8"  # requested is None: the checkpoint decides


def quant_config(name: str | None) -> QuantConfig | None:
    """The scheme object for an EngineArgs.quantization value (None: no quantization)."""
    check_quantization(name)
    if name is None:
        return None
    from engine.quant.fp8 import Fp8Config

    return Fp8Config()


__all__ = [
    "KNOWN_UNSUPPORTED",
    "SUPPORTED_QUANTIZATION",
    "QuantConfig",
    "check_quantization",
    "model_quantization",
    "quant_config",
]
