"""Models of the engine: one decoder template for the Llama / Mistral / Qwen2 / Qwen3 families.

build_model allocates an empty model; load_model builds it and fills it from an HF safetensors checkpoint.
"""
from engine.models.decoder import DecoderModel, build_model
from engine.models.weights import iter_safetensors, load_model, safetensors_files

__all__ = ["DecoderModel", "build_model", "iter_safetensors", "load_model", "safetensors_files"]
