"""Compiled-engine artifacts: what lets a cold process skip work, under a key naming everything that
makes it valid.

An artifact is a directory `<model>/engines/<id>/` (or under another root) holding `artifact.json`
(the key, the KV-sizing record, the CUDA-graph batch sizes, the build's smoke tokens and time) and
`triton-cache/`: every kernel the engine compiled for this model, GPU and software stack while it
was built. select() picks one for ENGINE_MODE; install() puts its kernels where Triton looks and
returns the engine arguments its record implies.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ARTIFACT_FORMAT = 1
ARTIFACT_FILE = "artifact.json"
TRITON_DIR = "triton-cache"
INSTALLED_DIR = ".coldbrew-installed"  # in Triton's cache: one empty file per artifact installed
ENGINES_DIR = "engines"
ENGINE_MODES = ("auto", "jit", "compiled")
# The key's fields, in the order a mismatch names them: what was built for must be what runs.
KEY_FIELDS = (
    "format",
    "model_digest",
    "gpu_arch",
    "gpu_memory_gib",
    "torch",
    "triton",
    "cuda",
    "kernel_code",
    "dtype",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "gpu_memory_utilization",
    "kv_cache_dtype",
    "quantization",
)
# Fields a key holds only when they differ from their default, so the keys (and ids) of engines
# built before the field existed stay valid: an FP8 KV cache changes the attention kernels and the
# KV sizing ("fp8" is spelled "fp8_e4m3", the same kernels); FP8 weights (QUANTIZATION=fp8, or an
# FP8 checkpoint) change the linears' kernels and halve the weights the KV sizing measured beside.
DEFAULTED_FIELDS = {"kv_cache_dtype": "auto", "quantization": None}
# An artifact with no measured KV-sizing record (built without a GPU, or published by a worker that
# sized its cache analytically) holds kernels only, which depend on neither field: its key says
# "any" in both.
ANY_MEMORY = "any"
WILDCARD_FIELDS = ("gpu_memory_gib", "gpu_memory_utilization")


class ArtifactError(RuntimeError):
    """ENGINE_MODE=compiled and no artifact matches: the message is one line naming the fields that
    differ."""


# ---- the key -------------------------------------------------------------------------------------
def artifact_key(model_digest: str, limits: dict, device: dict, software: dict) -> dict:
    """The key from its parts (pure: tests build keys for machines they are not on).

    limits: dtype, max_model_len, max_num_seqs, max_num_batched_tokens, block_size,
    gpu_memory_utilization (and kv_cache_dtype, left out when "auto", and quantization, left out
    when None: see DEFAULTED_FIELDS).
    device: gpu_arch ("sm_90"), gpu_memory_gib. software: torch, triton, cuda versions."""
    key = {"format": ARTIFACT_FORMAT, "model_digest": model_digest, **device, **software, **limits}
    missing = [f for f in KEY_FIELDS if f not in key and f not in DEFAULTED_FIELDS]
    if missing:
        raise ValueError(f"artifact key: missing {', '.join(missing)}")
    return {
        f: key[f]
        for f in KEY_FIELDS
        if f in key and not (f in DEFAULTED_FIELDS and key[f] == DEFAULTED_FIELDS[f])
    }


def key_id(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _limits(args, device) -> dict:
    """The key's engine fields for EngineArgs `args` on `device` (dtype "auto" resolved as the
    engine does)."""
    from engine.config import ModelConfig
    from engine.models.weights import resolve_dtype
    from engine.quant import model_quantization

    cfg = ModelConfig.from_dir(args.model)
    return {
        "dtype": str(resolve_dtype(args.dtype, cfg, device)).removeprefix("torch."),
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "kv_cache_dtype": "fp8_e4m3" if args.kv_cache_dtype == "fp8" else args.kv_cache_dtype,
        "quantization": model_quantization(args.quantization, cfg),
    }


def kernel_code_digest(root: Path | None = None) -> str:
    """A digest of the code that defines the kernels and which variants a step launches (every
    source file of the engine package, and the kernel set the build traces) under `root` (this
    checkout): an artifact built by other code may lack the kernels this code launches."""
    root = root or Path(__file__).resolve().parent.parent
    files = sorted((root / "engine").rglob("*.py")) + [root / "warmup" / "kernel_set.py"]
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _software() -> dict:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "kernel_code": kernel_code_digest(),
    }


def current_key(args) -> dict:
    """The key this process would need, for EngineArgs `args` on its CUDA device (imports torch and
    triton)."""
    import torch

    from engine.models.weights import model_digest

    device = args.torch_device()
    if device.type != "cuda":
        raise ArtifactError(
            f"compiled engines are for CUDA devices; this engine runs on {device.type}"
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return artifact_key(
        model_digest(args.model),
        _limits(args, device),
        {
            "gpu_arch": f"sm_{props.major}{props.minor}",
            "gpu_memory_gib": round(props.total_memory / (1 << 30)),
        },
        _software(),
    )


def gpuless_key(args, arch: str) -> dict:
    """The key of an artifact built without a GPU for `arch` ("sm_90"): this install's torch, triton
    and CUDA, and any memory size and utilization (it holds kernels only; the KV-sizing record needs
    the GPU)."""
    import torch

    from engine.models.weights import model_digest

    key = artifact_key(
        model_digest(args.model),
        _limits(args, torch.device("cuda")),
        {"gpu_arch": arch, "gpu_memory_gib": None},
        _software(),
    )
    return any_memory(key)


def any_memory(key: dict) -> dict:
    """`key` as an artifact without a memory record carries it: valid for any GPU memory size and
    utilization."""
    return {**key, **{f: ANY_MEMORY for f in WILDCARD_FIELDS}}


def mismatches(built: dict, wanted: dict) -> list[str]:
    """'field (built for X, this worker Y)' for each key field that differs, in KEY_FIELDS order."""

    def get(key: dict, f: str):
        return key.get(f, DEFAULTED_FIELDS.get(f))

    return [
        f"{f} (built for {get(built, f)!r}, this worker {get(wanted, f)!r})"
        for f in KEY_FIELDS
        if get(built, f) != get(wanted, f)
        and not (f in WILDCARD_FIELDS and built.get(f) == ANY_MEMORY)
    ]


# ---- finding and choosing ------------------------------------------------------------------------
def artifact_roots(model_dir: str, cache_dir: str | None = None) -> list[str]:
    """Where artifacts live: beside the model's snapshot, then the cache dir's engines/."""
    roots = [os.path.join(model_dir, ENGINES_DIR)]
    if cache_dir:
        roots.append(os.path.join(cache_dir, ENGINES_DIR))
    return roots


def find_artifacts(roots: list[str]) -> list[tuple[str, dict]]:
    """(directory, artifact.json contents) of every readable artifact under the roots."""
    out = []
    for root in roots:
        try:
            names = sorted(os.listdir(root))
        except OSError:
            continue
        for name in names:
            if name.startswith("."):  # a build, a publish or a lock in progress
                continue
            path = os.path.join(root, name)
            try:
                with open(os.path.join(path, ARTIFACT_FILE)) as f:
                    out.append((path, json.load(f)))
            except (OSError, ValueError):
                continue
    return out


@dataclass(frozen=True)
class Selection:
    mode: str  # "compiled" or "jit": what runs
    artifact: str | None  # the artifact directory (compiled)
    reason: str  # one line: why this mode


def _check_mode(mode: str) -> None:
    if mode not in ENGINE_MODES:
        raise ValueError(f"ENGINE_MODE: must be one of {', '.join(ENGINE_MODES)}, got {mode!r}")


def select(mode: str, roots: list[str], key: dict) -> Selection:
    """ENGINE_MODE -> what runs. compiled without a matching artifact raises ArtifactError (one line
    naming the fields of the closest artifact that differ); auto falls back to jit with that line as
    its reason."""
    _check_mode(mode)
    if mode == "jit":
        return Selection("jit", None, "ENGINE_MODE=jit")
    found = [(path, data.get("key", {})) for path, data in find_artifacts(roots)]
    found = [(path, built, mismatches(built, key)) for path, built in found]
    matching = [(built != key, path) for path, built, differs in found if not differs]
    # an exact match (a GPU build, with its memory record) before one for any memory size
    if matching:
        path = min(matching)[1]
        return Selection("compiled", path, f"compiled engine {path} matches this worker")
    found = [(path, differs) for path, _, differs in found]
    if found:
        path, differs = min(found, key=lambda pd: len(pd[1]))
        why = f"the closest, {path}, differs in " + "; ".join(differs)
    else:
        why = f"none was found in {', '.join(roots)}"
    line = f"no compiled engine matches this worker: {why}"
    if mode == "compiled":
        raise ArtifactError(f"ENGINE_MODE=compiled: {line}")
    return Selection("jit", None, f"ENGINE_MODE=auto: jit, {line}")


def install(artifact: str, triton_cache_dir: str | None = None) -> dict:
    """Copy the artifact's kernels into Triton's cache (the current one unless given; entries
    already there are kept) and return the EngineArgs overrides of its record: the measured KV step
    and the graph sizes."""
    if triton_cache_dir is None:
        import triton.knobs

        triton_cache_dir = triton.knobs.cache.dir
    with open(os.path.join(artifact, ARTIFACT_FILE), "rb") as f:
        raw = f.read()
    record = json.loads(raw)["record"]
    # One file says this very artifact (its record's hash) is all in this cache already: a later
    # start skips the walk, whose hundreds of small file-system calls each wait behind the weight
    # stream's reads when the page cache is cold.
    done = os.path.join(triton_cache_dir, INSTALLED_DIR, hashlib.sha256(raw).hexdigest()[:16])
    src = os.path.join(artifact, TRITON_DIR)
    if os.path.isdir(src) and not os.path.exists(done):
        shutil.copytree(src, triton_cache_dir, dirs_exist_ok=True, copy_function=_copy_if_missing)
        try:
            os.makedirs(os.path.dirname(done), exist_ok=True)
            open(done, "w").close()
        except OSError as e:  # a read-only cache: the walk again next time, nothing worse
            log.info("compiled engine: could not note the installed kernels (%s)", e)
    overrides = {"cuda_graph_sizes": record["graph_sizes"]}
    # measured on the GPU; without it the analytic bound sizes the KV cache
    if record.get("kv_step_bytes") is not None:
        overrides["kv_step_bytes"] = record["kv_step_bytes"]
    return overrides


def _copy_if_missing(src: str, dst: str) -> str:
    """Copy one cache file. Triton's group files (__grp__*.json) list their kernel's files by
    absolute path, which named the build's directory: they are rewritten to where the files are now,
    or Triton would compile again."""
    if os.path.exists(dst):
        return dst
    if not os.path.basename(src).startswith("__grp__"):
        shutil.copy2(src, dst)
        return dst
    with open(src) as f:
        group = json.load(f)
    here = os.path.dirname(dst)
    group["child_paths"] = {
        name: os.path.join(here, os.path.basename(path))
        for name, path in group.get("child_paths", {}).items()
    }
    tmp = f"{dst}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(group, f)
    os.replace(tmp, dst)
    return dst


def pull_matching(key: dict, remote: str, cache_dir: str, opts=None) -> str | None:
    """The artifact for `key` from a fleet cache (remote/engines/<id>, as `warmup build --push` or a
    worker's publish wrote it: the exact key first, then the key for any memory size) into
    cache_dir/engines/<id>, atomically; None when the fleet has none. Raises
    cache.remote.RemoteError."""
    for wanted in (key, any_memory(key)):
        path = _pull_one(key_id(wanted), remote, cache_dir, opts)
        if path is not None:
            return path
    return None


def _pull_one(name: str, remote: str, cache_dir: str, opts) -> str | None:
    import tempfile

    from cache.remote import join_uri, pull_dir

    dest = os.path.join(cache_dir, ENGINES_DIR, name)
    if os.path.isfile(os.path.join(dest, ARTIFACT_FILE)):
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".pull-", dir=os.path.dirname(dest))
    try:
        if pull_dir(join_uri(remote, ENGINES_DIR, name), staging, opts, progress=False) is None:
            return None
        try:
            os.rename(staging, dest)
        except OSError:  # another worker published it first
            pass
        return dest
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def prepare(
    mode: str, args, cache_dir: str | None = None, remote: str | None = None, s3_options=None
):
    """ENGINE_MODE applied to EngineArgs `args` (call once torch is up): -> (the args to build the
    engine with, the Selection). compiled installs the artifact's kernels and takes its KV-sizing
    record and graph sizes.
    remote (s3://...): with no matching artifact on disk, one pushed there for this key is pulled
    first."""
    import dataclasses

    _check_mode(mode)
    if mode == "jit":
        return args, Selection("jit", None, "ENGINE_MODE=jit")
    device = args.torch_device().type
    if device != "cuda":
        if mode == "compiled":
            raise ArtifactError(
                f"ENGINE_MODE=compiled: compiled engines are for CUDA devices; this engine runs on "
                f"{device}"
            )
        return args, Selection("jit", None, f"ENGINE_MODE=auto: jit, the engine runs on {device}")
    key, roots = current_key(args), artifact_roots(args.model, cache_dir)
    # none on disk: the fleet may have one
    if remote and cache_dir and select("auto", roots, key).mode == "jit":
        from cache.remote import RemoteError

        try:
            if pull_matching(key, remote, cache_dir, s3_options):
                log.info("engine mode: pulled the compiled engine %s from %s", key_id(key), remote)
        except RemoteError as e:
            log.warning("engine mode: no compiled engine from the fleet cache (%s)", e)
    sel = select(mode, roots, key)
    if sel.mode == "compiled":
        args = dataclasses.replace(args, **install(sel.artifact))
    return args, sel
