"""Model sources: parse a reference (hub repo id, s3://, local dir, RunPod cached model, .gguf) and
fetch its files.

Each fetch writes only the files the engine reads into a staging directory and returns their sizes
and sha256; config.json comes first, so an unsupported model is refused before any weight moves.
The Hugging Face Hub source is cache/hub.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from cache.snapshot import MANIFEST, check_snapshot, hash_files, list_files

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_WEIGHTS = "model.safetensors"
# What the engine reads besides the weights (engine/config.py, tokenizer.py, chat_template.py; fast
# tokenizers only: no tokenizer.model, vocab.json, merges.txt), and the generation defaults.
SMALL_FILES = frozenset(
    {
        CONFIG_FILE,
        "generation_config.json",
        INDEX_FILE,
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "chat_template.json",
    }
)
TEMPLATES_DIR = "additional_chat_templates"  # more named chat templates, one .jinja file each
DEFAULT_BASE_PATH = "/runpod-volume"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")


class SourceError(RuntimeError):
    """A source could not give the model: the message names the source and the reason, never a
    credential."""


@dataclass(frozen=True)
class Source:
    """A parsed model reference. kind: hub | s3 | local | gguf; location: repo id, s3 URI or
    absolute path."""

    kind: str
    location: str

    @property
    def key(self) -> str:
        """A path-safe name for the cache (hub ids lower-cased: the hub matches them
        case-insensitively)."""
        if self.kind == "hub":
            return "hf--" + self.location.lower().replace("/", "--")
        if self.kind == "s3":
            return "s3--" + re.sub(r"[^A-Za-z0-9._-]+", "--", self.location[5:].strip("/"))
        stem = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(self.location).name)
        return f"{self.kind}--{stem}-{hashlib.sha256(self.location.encode()).hexdigest()[:8]}"

    @property
    def display(self) -> str:
        return f"hf://{self.location}" if self.kind == "hub" else self.location


def parse(ref: str) -> Source:
    """The Source a model reference names: an existing directory or .gguf file, s3://bucket/prefix,
    or a hub id."""
    if not isinstance(ref, str) or not ref.strip():
        raise ValueError(
            "model: must be a hub repo id, s3://bucket/prefix, a directory or a .gguf file, "
            f"got {ref!r}"
        )
    ref = ref.strip()
    if ref.startswith("s3://"):
        from cache.remote import split_uri

        split_uri(ref)
        return Source("s3", ref.rstrip("/"))
    path = Path(ref).expanduser()
    if path.is_dir():
        return Source("local", str(path.resolve()))
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ValueError(f"model: GGUF file {ref!r} does not exist")
        return Source("gguf", str(path.resolve()))
    repo_id = ref.removeprefix("hf://")
    if _REPO_ID.fullmatch(repo_id) and ".." not in repo_id:
        return Source("hub", repo_id)
    raise ValueError(
        f"model: {ref!r} is neither an existing directory, a .gguf file, s3://bucket/prefix "
        "nor a hub repo id (org/name)"
    )


def is_commit(revision: str | None) -> bool:
    return bool(revision) and bool(_COMMIT.fullmatch(revision))


def check_model_dir(path: Path) -> str | None:
    """None when path has config.json and its safetensors (every shard its index names), else what
    is missing."""
    if not (path / "config.json").is_file():
        return "no config.json"
    index = next(iter(sorted(path.glob("*.safetensors.index.json"))), None)
    if index is not None:
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return f"unreadable {index.name}"
        missing = sorted(s for s in shards if not (path / s).is_file())
        return f"missing shards {missing[:3]}" if missing else None
    return None if any(path.glob("*.safetensors")) else "no *.safetensors"


# ---- what the engine reads ---------------------------------------------------------------------
def small_files(names: Iterable[str]) -> list[str]:
    """The files of a listing the engine reads besides the weights: config, tokenizer, chat
    templates, weight index."""
    return sorted(
        n
        for n in names
        if n in SMALL_FILES
        or (n.startswith(TEMPLATES_DIR + "/") and n.endswith(".jinja") and n.count("/") == 1)
    )


def weight_files(names: Iterable[str], index: dict | None, where: str) -> list[str]:
    """The safetensors the engine loads, picked as engine/models/weights.py picks them: the shards
    the index names, else model.safetensors, else every top-level *.safetensors; never
    consolidated*.safetensors (Mistral's own format, a second copy of the same weights)."""
    names = set(names)
    if index is not None:
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise SourceError(f"{where}: {INDEX_FILE} has no weight_map")
        shards = sorted(set(map(str, weight_map.values())))
        absent = [s for s in shards if s not in names or s.startswith("/") or ".." in Path(s).parts]
        if absent:
            raise SourceError(
                f"{where}: {INDEX_FILE} names shards that are not in the repo: {absent[:3]}"
            )
        return shards
    if SINGLE_WEIGHTS in names:
        return [SINGLE_WEIGHTS]
    found = sorted(
        n
        for n in names
        if n.endswith(".safetensors") and "/" not in n and not n.startswith("consolidated")
    )
    if not found:
        raise SourceError(
            f"{where}: no safetensors weights (model.safetensors, or shards and "
            f"{INDEX_FILE}); only safetensors are loaded"
        )
    return found


def check_first_files(
    dest: Path, where: str, check_config: Callable[[dict], Any] | None
) -> dict | None:
    """Read config.json (and the weight index) fetched into dest ahead of the weights, and let
    check_config refuse the model (its ValueError, passed on naming `where`). Returns the index,
    None without one."""

    def read(name: str) -> dict:
        try:
            return json.loads((dest / name).read_text())
        except (OSError, ValueError) as e:
            reason = f"{name} is not readable JSON ({type(e).__name__})"
            raise SourceError(f"{where}: {reason}") from None

    config = read(CONFIG_FILE)
    if check_config is not None:
        try:
            check_config(config)
        except ValueError as e:
            raise SourceError(
                f"{where}: this model is not supported, refused before downloading its weights: {e}"
            ) from None
    return read(INDEX_FILE) if (dest / INDEX_FILE).is_file() else None


# ---- a local directory ---------------------------------------------------------------------------
def open_local(path: str, verify: str = "size") -> Path:
    """A local model directory, used in place; one carrying a coldbrew manifest is verified against
    it."""
    root = Path(path)
    reason = check_snapshot(root, verify) if (root / MANIFEST).exists() else check_model_dir(root)
    if reason is not None:
        raise SourceError(f"model directory {root}: {reason}")
    return root


# ---- the RunPod cached-model layout --------------------------------------------------------------
def find_runpod_cached(
    base_path: str | os.PathLike | None, repo_id: str, revision: str | None
) -> Path | None:
    """<base>/huggingface-cache/hub/models--org--name/snapshots/<commit>/ for repo_id (org/name
    compared case-insensitively) at a commit, or at the commit its refs/<revision> names; None when
    absent or incomplete."""
    if not base_path:
        return None
    hub = Path(base_path) / "huggingface-cache" / "hub"
    wanted = "models--" + repo_id.replace("/", "--").lower()
    try:
        repos = [p for p in hub.iterdir() if p.name.lower() == wanted and p.is_dir()]
    except OSError:
        return None
    for repo in repos:
        commit = revision if is_commit(revision) else None
        if commit is None:
            try:
                commit = (repo / "refs" / (revision or "main")).read_text().strip()
            except OSError:
                snaps = [p for p in (repo / "snapshots").glob("*") if p.is_dir()]
                # RunPod caches one snapshot; no ref written
                if revision is None and len(snaps) == 1:
                    commit = snaps[0].name
        if commit and check_model_dir(repo / "snapshots" / commit) is None:
            return repo / "snapshots" / commit
    return None


# ---- S3 ------------------------------------------------------------------------------------------
def fetch_s3(
    uri: str,
    dest: Path,
    opts=None,
    progress: bool = True,
    check_config: Callable[[dict], Any] | None = None,
) -> dict[str, dict]:
    """Download the engine's files under an s3:// prefix into dest: config.json and the weight index
    first (for check_config to refuse the model), then the rest. When the prefix carries a coldbrew
    manifest, every file is checked against it. Returns {name: {size, sha256}}."""
    from cache import remote

    s3 = remote.client(opts)
    listing = remote.list_dir(uri, opts, s3)
    if CONFIG_FILE not in listing:
        raise SourceError(
            f"{uri}: no {CONFIG_FILE} under this prefix (an HF-format model directory is needed)"
        )
    first = [n for n in (CONFIG_FILE, INDEX_FILE) if n in listing]
    remote.download_dir(uri, dest, {n: listing[n] for n in first}, opts, s3, progress)
    index = check_first_files(dest, uri, check_config)
    names = sorted(set(small_files(listing)) | set(weight_files(listing, index, uri)))
    rest = {n: listing[n] for n in names if n not in first}
    remote.download_dir(uri, dest, rest, opts, s3, progress)
    files = hash_files(dest, names)
    if MANIFEST in listing:
        want = json.loads(remote.read_text(remote.join_uri(uri, MANIFEST), opts, s3) or "{}").get(
            "files", {}
        )
        for name, entry in files.items():
            if name in want and want[name].get("sha256") != entry["sha256"]:
                raise SourceError(f"{uri}: {name} does not match the manifest stored beside it")
    return files


# ---- GGUF ----------------------------------------------------------------------------------------
def gguf_revision(path: str, dtype: str) -> str:
    """Names one conversion: the dtype plus the file's size and mtime (hashing a multi-GB file each
    start is not)."""
    st = os.stat(path)
    return f"{dtype}-{st.st_size}-{st.st_mtime_ns}"


def fetch_gguf(path: str, dest: Path, dtype: str = "float32") -> dict[str, dict]:
    """Dequantize a GGUF file into dest as an HF-format directory (once: the result is a
    snapshot)."""
    from cache.gguf import write_hf_dir

    log.info("dequantizing %s to %s (once)", path, dtype)
    write_hf_dir(path, dest, dtype)
    return hash_files(dest, list_files(dest))
