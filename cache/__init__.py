"""The snapshotted model cache: sources -> immutable snapshots -> packed weights -> streaming loader.

`resolve(ref)` turns a model reference into a local snapshot directory. Imports nothing of ours.
"""
from __future__ import annotations

from pathlib import Path


def resolve(ref: str, *, revision: str | None = None, cache_dir: str | None = None, **options) -> Path:
    """A model reference -> the path of a complete local snapshot (config, tokenizer, safetensors).

    This first version accepts local directories only; the snapshotted cache (hub, S3, RunPod volume, GGUF)
    replaces it with the same signature.
    """
    path = Path(ref).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise FileNotFoundError(f"model {ref!r}: not a local model directory (no config.json)")
