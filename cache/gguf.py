"""GGUF source: dequantize a .gguf checkpoint once into an HF-format directory (config, tokenizer, safetensors).

Conversion uses transformers (imported only here, only when a conversion runs) and publishes atomically.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path


def write_hf_dir(gguf_path: str, out_dir: str | os.PathLike, dtype: str = "float32") -> None:
    """Dequantize gguf_path into the existing directory out_dir: model.safetensors, config.json, tokenizer files."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    src_dir, name = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=getattr(torch, dtype))
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # the weights are dequantized now
    cfg["dtype"] = dtype
    if not cfg.get("architectures"):
        cfg["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(str(out))


def convert_gguf(gguf_path: str, dest: str, dtype: str = "float32") -> str:
    """Write gguf_path as an HF-format model directory at dest; a complete dest is reused as is."""
    dest_path = Path(dest)
    if (dest_path / "config.json").exists():
        return str(dest_path)
    dest_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest_path.parent, prefix=".tmp-gguf-"))
    try:
        write_hf_dir(gguf_path, tmp, dtype)
        os.chmod(tmp, 0o755)
        try:
            os.replace(tmp, dest_path)
        except OSError:  # another process published it first
            if not (dest_path / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dest_path)
