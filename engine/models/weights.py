"""Reads HF safetensors checkpoints (one file or sharded with an index) and loads them into a DecoderModel.

Uses `safetensors` only (never transformers, never pickle); the model maps HF names onto its fused parameters.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.models.decoder import DecoderModel, build_model

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's files: the shards named by the index, else model.safetensors, else every *.safetensors."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map") or {}
        if not weight_map:
            raise ValueError(f"weights: {INDEX_FILE} in {model_dir!r} has no weight_map")
        files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
        absent = [os.path.basename(p) for p in files if not os.path.isfile(p)]
        if absent:
            raise ValueError(f"weights: shards named by {INDEX_FILE} are missing in {model_dir!r}: {absent}")
        return files
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    found = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors")) if os.path.isdir(model_dir) else []
    if not found:
        raise ValueError(f"weights: no safetensors checkpoint in {model_dir!r} (only safetensors are loaded)")
    return [os.path.join(model_dir, n) for n in found]


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the checkpoint, one at a time."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(
    model_dir: str,
    model_config: ModelConfig,
    dtype: torch.dtype | str,
    device: torch.device | str,
    attn_backend=None,
) -> DecoderModel:
    """Build the model on `device` in `dtype` and fill it from the checkpoint in `model_dir`."""
    model = build_model(model_config, dtype, device, attn_backend)
    model.load_hf_weights(iter_safetensors(model_dir))
    return model
