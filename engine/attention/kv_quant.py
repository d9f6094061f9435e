"""The FP8 KV cache's format: which cache dtypes the engine takes (KV_CACHE_DTYPE's values), and the
reference quantize / dequantize every backend matches.

A stored value is `clamp(x * (1 / scale), -max, max)` in fp32 cast to the FP8 dtype (round to
nearest even); it reads back as `stored * scale`, with the attention math in the model's dtype and
fp32 after that. One scale per layer for K and one for V (docs/engine.md, "FP8 KV cache": why 1.0).
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
_FP8 = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The per-layer (K, V) scales: stored = x / scale.
DEFAULT_KV_SCALE = (1.0, 1.0)


def check_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache tensor's dtype: "auto" keeps the model's dtype, the fp8 names their FP8 type."""
    check_kv_cache_dtype(name)
    return model_dtype if name == "auto" else _FP8[name]


def check_kv_cache_device(kv_dtype: torch.dtype, device: torch.device) -> None:
    """An FP8 cache on a GPU needs FP8 conversions in Triton (compute capability 8.9+: Ada,
    Hopper); older GPUs are refused with their name."""
    if not is_fp8(kv_dtype) or device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"kv_cache_dtype fp8: {name} (compute capability {major}.{minor}) has no FP8 "
            "conversions for the Triton attention kernels (they need 8.9+, e.g. L4, L40S, H100); "
            "use kv_cache_dtype 'auto'"
        )


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x times the fp32 reciprocal of scale, in fp32 (what torch does for a division by a scalar
    on CUDA, and what the Triton write does: so every device stores the same bytes), clamped to the
    dtype's finite range (e4m3fn has no inf: an unclamped overflow would be NaN), cast with
    round-to-nearest-even."""
    limit = fp8_max(dtype)
    return (x.float() * (1.0 / scale)).clamp_(-limit, limit).to(dtype)


def dequantize(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """stored * scale in `dtype` (exact for scale 1.0: each FP8 value is a bf16/fp16/fp32 value)."""
    return stored.to(dtype) * scale if scale != 1.0 else stored.to(dtype)
