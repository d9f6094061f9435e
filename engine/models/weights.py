"""Loads a DecoderModel's weights: from a pack in the final layout through the streaming loader when
one exists, otherwise from HF safetensors (sharded or not), writing the pack for next time. Never
transformers, never pickle.

Under tensor parallelism each rank loads and packs only its own slice (one pack per rank,
cache.pack.shard_name), so each GPU streams its own bytes at start. load_format "dummy" fills random
weights on the device (benchmarks).
"""

# The model code (and triton with it) is imported inside the functions that build a model, so
# preload_weights can start the stream right after `import torch`, before the rest of the engine
# imports.
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from cache.loader import (
    LoadStats,
    PackError,
    PackWriter,
    discard_preloads,
    load_pack,
    pack_name,
    preload,
    read_pack,
    shard_name,
)
from engine.config import EngineArgs, ModelConfig, resolve_dtype
from engine.distributed.sharding import SINGLE, Shard
from engine.models.checkpoint_names import is_vision_tensor, text_decoder_name
from engine.models.prequantized import checkpoint_weights, expert_layout
from engine.quant import model_quantization

if TYPE_CHECKING:
    from engine.models.decoder import DecoderModel, WeightSlot

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Written by cache.snapshot: when present it names the snapshot's bytes.
MANIFEST_FILE = "coldbrew-manifest.json"
PACKS_DIR = "packs"
# Bump when the parameter names, fusions or byte layout of the pack change: old packs then no longer
# match.
PACK_LAYOUT_VERSION = 1
LOAD_FORMATS = ("auto", "pack", "safetensors", "dummy")


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's files: the shards named by the index, else model.safetensors, else every
    *.safetensors."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map") or {}
        if not weight_map:
            raise ValueError(f"weights: {INDEX_FILE} in {model_dir!r} has no weight_map")
        files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
        absent = [os.path.basename(p) for p in files if not os.path.isfile(p)]
        if absent:
            raise ValueError(
                f"weights: shards named by {INDEX_FILE} are missing in {model_dir!r}: {absent}"
            )
        return files
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    found = (
        sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
        if os.path.isdir(model_dir)
        else []
    )
    if not found:
        raise ValueError(
            f"weights: no safetensors checkpoint in {model_dir!r} (only safetensors are loaded)"
        )
    return [os.path.join(model_dir, n) for n in found]


# What iter_safetensors yields for a tensor the model never takes (a multimodal checkpoint's vision
# tower): the loader only needs its name.
_UNREAD = torch.empty(0)


def iter_safetensors(
    model_dir: str, slots: dict[str, "WeightSlot"] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the checkpoint, one at a time. With `slots` (a model's
    hf_weight_map), a tensor it names is read as its slot's slice only (then presliced=True), and a
    vision tower's tensor not at all (an empty tensor stands for it)."""
    for path in safetensors_files(model_dir):
        try:
            f = safe_open(path, framework="pt", device="cpu")
        except Exception as e:  # safetensors' own errors name no file
            size = os.path.getsize(path)
            raise ValueError(
                f"weights: {path} ({size} bytes) can't be read as safetensors ({e}): "
                "the file is truncated or corrupt; fetch it again"
            ) from e
        with f:
            for name in f.keys():
                slot = slots.get(text_decoder_name(name)) if slots is not None else None
                if slots is not None and slot is None and is_vision_tensor(name):
                    yield name, _UNREAD  # a vision tower's tensor: named, never read
                    continue
                part = f.get_slice(name) if slot is not None else None
                if part is not None and tuple(part.get_shape()) != slot.full:
                    shape = tuple(part.get_shape())
                    raise ValueError(
                        f"weights: {name} has shape {shape} but the model expects {slot.full}"
                    )
                if part is None or slot.count == slot.full[slot.dim]:  # not the model's, or whole
                    yield name, f.get_tensor(name)
                    continue
                cut = slice(slot.first, slot.first + slot.count)
                yield name, part[cut] if slot.dim == 0 else part[:, cut]


def checkpoint_tensors(model_dir: str, model: "DecoderModel") -> Iterator[tuple[str, torch.Tensor]]:
    """What load_hf_weights reads for `model`: its slices of the checkpoint, an FP8 checkpoint's
    weights paired with their scales (engine/models/prequantized.py)."""
    fmt = model.config.checkpoint_fp8
    if fmt is not None and fmt.activations == "static":
        log.warning(
            "weights: the checkpoint's static activation scales (input_scale) are not used; "
            "activations are quantized per token"
        )
    slots = model.hf_weight_map()
    tensors = iter_safetensors(model_dir, slots)
    if fmt is None:
        return tensors
    moe = model.config.moe
    experts = expert_layout(model.config.family, moe.expert_intermediate_size) if moe else None
    return checkpoint_weights(tensors, fmt, slots, experts)


# ---- which pack belongs to this checkpoint -------------------------------------------------------
def model_digest(model_dir: str) -> str:
    """The snapshot manifest's hash when cache wrote one; else config.json plus the weight files'
    names/sizes/mtimes."""
    h = hashlib.sha256()
    manifest = os.path.join(model_dir, MANIFEST_FILE)
    if os.path.isfile(manifest):
        with open(manifest, "rb") as f:
            h.update(b"manifest\0" + f.read())
        return h.hexdigest()
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        h.update(b"config\0" + f.read())
    for path in safetensors_files(model_dir):
        st = os.stat(path)
        h.update(f"\0{os.path.basename(path)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


def pack_key(
    model_dir: str, dtype: torch.dtype, shard: Shard = SINGLE, quantization: str | None = None
) -> dict:
    """What a pack must match to be used: the checkpoint's bytes, the final dtype, the engine's
    layout, the quantization scheme (absent for none) and, for a tensor-parallel rank, which slice
    it holds."""
    key = {
        "format": "coldbrew-weights",
        "model_digest": model_digest(model_dir),
        "dtype": _dtype_name(dtype),
        "layout_version": PACK_LAYOUT_VERSION,
    }
    if quantization is not None:
        key["quantization"] = quantization
    if shard.size > 1:
        key["shard"] = [shard.rank, shard.size]
    return key


def pack_path(
    model_dir: str,
    dtype: torch.dtype,
    pack_dir: str | None = None,
    shard: Shard = SINGLE,
    quantization: str | None = None,
) -> str:
    """<pack_dir or model_dir/packs>/<digest[:16]>-<dtype>[-<quantization>]-v<layout>.cbpack (a
    rank's: cache.pack.shard_name)"""
    key = pack_key(model_dir, dtype)
    whole = pack_name(key["model_digest"][:16], key["dtype"], quantization, PACK_LAYOUT_VERSION)
    name = shard_name(whole, shard.rank, shard.size)
    return os.path.join(pack_dir or os.path.join(model_dir, PACKS_DIR), name)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _group_of(name: str, num_layers: int) -> int:
    """Group 0: embeddings; 1..L: decoder layer i-1; L+1: final norm and lm_head (the ready order of
    a forward)."""
    if name.startswith("layers."):
        return 1 + int(name.split(".")[1])
    return 0 if name.startswith("embed_tokens.") else num_layers + 1


# ---- loading -------------------------------------------------------------------------------------
def preload_weights(args: EngineArgs) -> bool:
    """Start streaming the pack the engine built from `args` will load, to its GPU, now; True if
    started.

    Called right after `import torch` (before the engine imports and builds), so the copy overlaps
    all of that; load_model then takes the stream over. Nothing happens on CPU, without a matching
    pack, or for safetensors.
    Never raises: the real load reports any problem."""
    try:
        device = args.torch_device()
        if device.type != "cuda" or args.load_format in ("safetensors", "dummy"):
            return False
        cfg = ModelConfig.from_dir(args.model)
        shard = Shard(0, args.tensor_parallel_size)  # this process is rank 0
        dtype = resolve_dtype(args.dtype, cfg, device)
        quantization = model_quantization(args.quantization, cfg)
        path = pack_path(args.model, dtype, args.pack_dir, shard, quantization)
        if not os.path.isfile(path):
            return False
        return preload(path, device) is not None
    except Exception as e:  # noqa: BLE001 - only a head start
        log.debug("weights: no preload (%s: %s)", type(e).__name__, e)
        return False


def load_model(
    model_dir: str,
    model_config: ModelConfig,
    dtype: torch.dtype | str,
    device: torch.device | str,
    attn_backend=None,
    *,
    pack_dir: str | None = None,
    load_format: str = "auto",
    shard: Shard = SINGLE,
    comm=None,
    quantization: str | None = None,
) -> "DecoderModel":
    """Build the model on `device` in `dtype` and fill it (a tensor-parallel rank: its `shard`, with
    collectives `comm`); quantization (EngineArgs.quantization, e.g. "fp8"): its linears quantized
    as the bf16/fp16 checkpoint loads, one tensor at a time, and the pack holds them quantized.

    load_format "auto": from the pack when a valid one matches (model digest, dtype, layout), else
    from safetensors, then write the pack (a failure to write logs one line); "pack": the same, but
    a failure to write the pack raises; "safetensors": never read or write a pack; "dummy": random
    weights made on the device, nothing read. `model.load_stats` says what happened.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    device = torch.device(device)
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype, model_config, device)
    quantization = model_quantization(quantization, model_config)
    from engine.models.decoder import build_model

    if load_format in ("safetensors", "dummy"):
        discard_preloads()
        model = build_model(
            model_config, dtype, device, attn_backend, shard=shard, comm=comm, quant=quantization
        )
        if load_format == "dummy":
            fill_random(model)
        else:
            model.load_hf_weights(checkpoint_tensors(model_dir, model), presliced=True)
        model.load_stats = {"source": load_format}
        model.wait_weights = lambda: None
        return model
    path = pack_path(model_dir, dtype, pack_dir, shard, quantization)
    key = pack_key(model_dir, dtype, shard, quantization)
    discard_preloads(keep=path)  # a preload of another file would hold device memory for nothing
    try:
        return load_model_from_pack(
            path,
            key,
            model_config,
            dtype,
            device,
            attn_backend,
            shard=shard,
            comm=comm,
            quantization=quantization,
        )
    except (FileNotFoundError, NotADirectoryError):
        discard_preloads()
    except (PackError, OSError) as e:
        discard_preloads()
        log.warning("weights: %s; loading safetensors and rebuilding the pack", e)
    model = build_model(
        model_config, dtype, device, attn_backend, shard=shard, comm=comm, quant=quantization
    )
    model.load_hf_weights(checkpoint_tensors(model_dir, model), presliced=True)
    model.load_stats = {"source": "safetensors", "pack_written": None}
    model.wait_weights = lambda: None
    try:
        write_model_pack(model, path, key)
        model.load_stats["pack_written"] = path
    except Exception as e:  # best effort: the model is loaded; the next start just can't use a pack
        if load_format == "pack":
            raise
        log.warning(
            "weights: could not write the pack %s (%s: %s); later starts load safetensors",
            path,
            type(e).__name__,
            e,
        )
    return model


def load_model_from_pack(
    path: str,
    key: dict | None,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    attn_backend=None,
    overlap: bool | None = None,
    shard: Shard = SINGLE,
    comm=None,
    quantization: str | None = None,
    **loader_options,
) -> "DecoderModel":
    """The model with every parameter a view into one device buffer streamed from the pack at
    `path`.

    overlap (default: on CUDA) returns while the bytes still stream: each layer's first forward
    waits for its own group (the GPU waits on the group's copy event), so the first step computes
    early layers while later ones load; `model.wait_weights()` blocks until all are in. Raises
    FileNotFoundError when there is no pack and PackError when it is invalid or does not match `key`
    or the model's parameters (names, dtypes, shapes)."""
    from engine.models.decoder import build_model

    pack = read_pack(path)
    if key is not None and any(pack.metadata.get(k) != v for k, v in key.items()):
        raise PackError(f"pack {path}: built for {pack.metadata}, not for {key}")
    if pack.metadata.get("quantization") != quantization:  # also without a key
        raise PackError(
            f"pack {path}: quantization {pack.metadata.get('quantization')!r}, not {quantization!r}"
        )
    model = build_model(
        model_config,
        dtype,
        device,
        attn_backend,
        param_device="meta",
        shard=shard,
        comm=comm,
        quant=quantization,
    )
    params = dict(model.named_parameters())
    want = {n: (_dtype_name(p.dtype), tuple(p.shape)) for n, p in params.items()}
    have = {e.name: (e.dtype, e.shape) for e in pack.entries}
    if want != have:
        diff = sorted(set(want.items()) ^ set(have.items()))[:3]
        raise PackError(f"pack {path}: tensors do not match the model's parameters (e.g. {diff})")
    load = load_pack(pack, device, **loader_options)
    views = {id(params[name]): view for name, view in load.tensors.items()}
    for module_name, module in model.named_modules():
        for leaf, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[leaf] = nn.Parameter(views[id(p)], requires_grad=False)
    model.load_stats = {
        "source": "pack",
        "path": path,
        "nbytes": pack.data_nbytes,
        "streaming": True,
    }

    def finished(stats: LoadStats) -> None:
        model.load_stats = {
            "source": "pack",
            "path": path,
            "nbytes": stats.nbytes,
            "seconds": stats.seconds,
            "gbps": stats.gbps,
            "alloc_seconds": stats.alloc_seconds,
            "pin_seconds": stats.pin_seconds,
            "mode": stats.mode,
            "threads": stats.threads,
            "chunk_bytes": stats.chunk_bytes,
        }
        log.info(
            "weights: pack %s, %.2f GB in %.2f s (%.1f GB/s, %s reads)",
            path,
            stats.nbytes / 1e9,
            stats.seconds,
            stats.gbps,
            stats.mode,
        )

    if overlap is None:
        overlap = device.type == "cuda"
    model.wait_weights = _wait_hooks(model, load, finished) if overlap else (lambda: None)
    if not overlap:
        finished(load.wait())
    return model


def _wait_hooks(model: "DecoderModel", load, finished):
    """Forward pre-hooks: embeddings wait for group 0, layer i for group i+1, the final norm for
    everything (then every hook is removed, so later steps and CUDA graph captures see a plain
    model). Returns wait_all()."""
    handles: list = []
    done = threading.Lock()
    state = {"finished": False}

    def wait_all(*_) -> None:
        with done:
            if state["finished"]:
                return
            stats = load.wait()
            for h in handles:
                h.remove()
            state["finished"] = True
        finished(stats)

    def wait_group(group: int):
        def hook(module, args) -> None:
            if state["finished"]:
                return
            if load.cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "weights: still streaming while a CUDA graph captures; "
                    "call model.wait_weights()"
                )
            load.wait_group(group)

        return hook

    groups = set(load.pack.groups)
    modules = [(0, model.embed_tokens)] + [(1 + i, layer) for i, layer in enumerate(model.layers)]
    handles += [m.register_forward_pre_hook(wait_group(g)) for g, m in modules if g in groups]
    handles.append(model.norm.register_forward_pre_hook(wait_all))
    return wait_all


@torch.no_grad()
def fill_random(model: "DecoderModel", seed: int = 0) -> None:
    """Benchmark weights made where the parameters live: norms 1, everything else N(0, 0.02) (as
    bench/checkpoint.py synthesizes checkpoints; quantized linears quantize theirs); the vocabulary
    padding stays zero."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed + model.shard.rank)
    quantized = model.quantized_linears()
    for name, linear in quantized.items():
        linear.fill_random(0.02, gen)
    for name, p in model.named_parameters():
        if name in quantized or name.removesuffix("_scale") in quantized:
            continue
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    model.zero_vocab_padding()


def write_model_pack(model: nn.Module, path: str, key: dict) -> str:
    """Write the model's parameters, in their final (fused) layout and dtype, as a pack at `path`,
    atomically."""
    num_layers = getattr(getattr(model, "config", None), "num_layers", 0)
    with PackWriter(path, metadata=key) as writer:
        for name, p in model.named_parameters():
            host = p.detach().contiguous().cpu().reshape(-1)
            writer.add(
                name,
                _dtype_name(p.dtype),
                tuple(p.shape),
                host.view(torch.uint8).numpy(),
                group=_group_of(name, num_layers),
            )
    return path
