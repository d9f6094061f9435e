"""Synthesize a random-weight HF-format checkpoint (config.json + sharded safetensors) of a real
architecture.

Speed does not depend on weight values, and the GPU machine has no network: benchmarks build their
models here. A model whose checkpoint and pack do not both fit the machine's disk (Qwen3-30B-A3B's
61 GB twice on 64 GB) gets sparse shards and its pack written directly (synthesize_packed).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.config import ModelConfig, resolve_dtype
from engine.models import build_model
from engine.models.weights import INDEX_FILE, fill_random, pack_key, pack_path, write_model_pack

CONFIGS = Path(__file__).resolve().parent / "configs"


def hf_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of the architecture with its shape, read off the engine's own weight
    map."""
    model = build_model(ModelConfig.from_dict(config), torch.bfloat16, "meta")
    return {name: slot.full for name, slot in model.hf_weight_map().items()}


def synthesize(
    config_name: str, out_dir: str, shard_bytes: int = 5 << 30, device: str = "cpu", seed: int = 0
) -> str:
    """Write `configs/<config_name>` with N(0, 0.02) bf16 weights (norms = 1) to out_dir; reuse a
    complete one."""
    out = Path(out_dir)
    if (out / INDEX_FILE).exists():
        return str(out)
    config, shapes, tmp = _begin(config_name, out)
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal shard, size
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard, size = {}, 0

    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()
        shard[name] = t
        size += t.numel() * 2
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    _write_config_and_index(tmp, config, shapes, weight_map)
    os.replace(tmp, out)
    return str(out)


def _begin(config: str | dict, out: Path) -> tuple[dict, dict[str, tuple[int, ...]], Path]:
    """(the config: bench/configs/<config>, or the dict itself; its HF tensor shapes; an empty
    directory beside `out` to write into, moved onto `out` when complete)."""
    config = config if isinstance(config, dict) else json.loads((CONFIGS / config).read_text())
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return config, hf_tensor_shapes(config), tmp


def _write_config_and_index(
    tmp: Path, config: dict, shapes: dict[str, tuple[int, ...]], weight_map: dict[str, str]
) -> None:
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    index = {
        "metadata": {"total_size": sum(2 * _numel(s) for s in shapes.values())},
        "weight_map": weight_map,
    }
    (tmp / INDEX_FILE).write_text(json.dumps(index))


def write_sparse_shard(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A valid bf16 safetensors file of `shapes` whose tensors are all zeros and take no disk
    blocks: the header, then the file extended to its full size (a hole where the data would be)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        nbytes = 2 * _numel(shape)
        header[name] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


def synthesize_packed(
    config: str | dict,
    out_dir: str,
    shard_bytes: int = 5 << 30,
    device: str = "cuda",
    seed: int = 0,
) -> str:
    """Write `configs/<config>` (or a config dict) to out_dir as sparse zero-filled shards with
    their index, then the engine's pack of random weights made on `device` (engine.models.weights'
    dummy fill, the seed's), keyed to those files; reuse a complete one. A start then loads the
    pack and never reads the shards, and the disk holds the pack's bytes only. The shards' tensors
    are zeros: a reference that reads them (transformers) sees another model than the pack."""
    out = Path(out_dir)
    if (out / INDEX_FILE).exists():
        return str(out)
    config, shapes, tmp = _begin(config, out)
    shards: list[dict[str, tuple[int, ...]]] = [{}]
    size = 0
    for name, shape in shapes.items():
        if size >= shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = shape
        size += 2 * _numel(shape)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_sparse_shard(tmp / file, shard)
        weight_map.update({name: file for name in shard})
    _write_config_and_index(tmp, config, shapes, weight_map)
    model_cfg = ModelConfig.from_dict(config)
    # the dtype the engine takes for "auto" on that device, which names and keys the pack
    dtype = resolve_dtype("auto", model_cfg, torch.device(device))
    model = build_model(model_cfg, dtype, device)
    fill_random(model, seed)
    os.replace(tmp, out)  # the key hashes the files' names, sizes and times, which a rename keeps
    write_model_pack(model, pack_path(str(out), dtype), pack_key(str(out), dtype))
    return str(out)


def config_only_dir(config: dict, name: str, root: str) -> str:
    """<root>/<name>-config holding only config.json: load_format="dummy" makes the weights on the
    device."""
    d = Path(root) / f"{name}-config"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
