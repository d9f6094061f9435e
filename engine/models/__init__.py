"""Models of the engine: one decoder template for the Llama, Mistral, Qwen, Phi-3, Gemma families.

build_model allocates an empty model; load_model builds it and fills it (names resolve on first use,
so the weights' preload does not import the model code, and triton with it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "DecoderModel": "engine.models.decoder",
    "build_model": "engine.models.decoder",
    "iter_safetensors": "engine.models.weights",
    "load_model": "engine.models.weights",
    "preload_weights": "engine.models.weights",
    "safetensors_files": "engine.models.weights",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # the same names for type checkers ("X as X": a re-export)
    from engine.models.decoder import DecoderModel as DecoderModel, build_model as build_model
    from engine.models.weights import (
        iter_safetensors as iter_safetensors,
        load_model as load_model,
        preload_weights as preload_weights,
        safetensors_files as safetensors_files,
    )


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine.models' has no attribute {name!r}")
