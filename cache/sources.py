"""Model sources: parse a reference (hub repo id, s3://, local dir, RunPod cached model, .gguf) and fetch its files.

Each fetch writes only the files the engine needs into a staging directory and returns their sizes and sha256.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cache.redact import hide_secrets, mask, secret_value
from cache.snapshot import MANIFEST, check_snapshot, hash_files, list_files

log = logging.getLogger(__name__)

# What the engine reads: config, generation config, tokenizer, chat template, safetensors (+ index). No pickles.
ENGINE_FILES = [
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt",
    "chat_template.jinja", "chat_template.json",
    "*.safetensors", "*.safetensors.index.json",
]
DEFAULT_BASE_PATH = "/runpod-volume"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")


class SourceError(RuntimeError):
    """A source could not give the model: the message names the source and the reason, never a credential."""


@dataclass(frozen=True)
class Source:
    """A parsed model reference. kind: hub | s3 | local | gguf; location: repo id, s3 URI or absolute path."""

    kind: str
    location: str

    @property
    def key(self) -> str:
        """A path-safe name for the cache (hub ids lower-cased: the hub matches them case-insensitively)."""
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
    """The Source a model reference names: an existing directory or .gguf file, s3://bucket/prefix, or a hub id."""
    if not isinstance(ref, str) or not ref.strip():
        raise ValueError(f"model: must be a hub repo id, s3://bucket/prefix, a directory or a .gguf file, got {ref!r}")
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
    raise ValueError(f"model: {ref!r} is neither an existing directory, a .gguf file, s3://bucket/prefix "
                     "nor a hub repo id (org/name)")


def is_commit(revision: str | None) -> bool:
    return bool(revision) and bool(_COMMIT.fullmatch(revision))


def check_model_dir(path: Path) -> str | None:
    """None when path has config.json and its safetensors (every shard its index names), else what is missing."""
    if not (path / "config.json").is_file():
        return "no config.json"
    index = next(iter(sorted(path.glob("*.safetensors.index.json"))), None)
    if index is not None:
        import json

        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return f"unreadable {index.name}"
        missing = sorted(s for s in shards if not (path / s).is_file())
        return f"missing shards {missing[:3]}" if missing else None
    return None if any(path.glob("*.safetensors")) else "no *.safetensors"


# ---- a local directory ------------------------------------------------------------------------------------------
def open_local(path: str, verify: str = "size") -> Path:
    """A local model directory, used in place; one carrying a coldbrew manifest is verified against it."""
    root = Path(path)
    reason = check_snapshot(root, verify) if (root / MANIFEST).exists() else check_model_dir(root)
    if reason is not None:
        raise SourceError(f"model directory {root}: {reason}")
    return root


# ---- the RunPod cached-model layout ------------------------------------------------------------------------------
def find_runpod_cached(base_path: str | os.PathLike | None, repo_id: str, revision: str | None) -> Path | None:
    """<base>/huggingface-cache/hub/models--org--name/snapshots/<commit>/ for repo_id (org/name compared
    case-insensitively) at a commit, or at the commit its refs/<revision> names; None when absent or incomplete."""
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
                if revision is None and len(snaps) == 1:  # RunPod caches one snapshot; no ref written
                    commit = snaps[0].name
        if commit and check_model_dir(repo / "snapshots" / commit) is None:
            return repo / "snapshots" / commit
    return None


# ---- the Hugging Face Hub ----------------------------------------------------------------------------------------
def _hub_error(repo_id: str, revision: str | None, endpoint: str | None, err: Exception) -> SourceError:
    from huggingface_hub import constants

    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    where = endpoint or constants.ENDPOINT
    return SourceError(mask(f"hub {repo_id} revision {revision or 'main'} at {where}: {type(err).__name__}: {first}"))


def hub_commit(repo_id: str, revision: str | None, *, token: Any = None, endpoint: str | None = None) -> str:
    """The commit hash a hub revision (branch, tag or commit) points at now."""
    from huggingface_hub import HfApi, get_token

    token = secret_value(token)
    hide_secrets(token or get_token())  # None: the client's own HF_TOKEN, hidden just the same
    if is_commit(revision):
        return revision  # type: ignore[return-value]
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(repo_id, revision=revision)
    except Exception as e:  # HTTP, connection, not-found, gated: all become one clear error
        raise _hub_error(repo_id, revision, endpoint, e) from None
    if not info.sha:
        raise SourceError(f"hub {repo_id} revision {revision or 'main'}: the hub returned no commit hash")
    return info.sha


def _git_blob_sha1(path: Path) -> str:
    digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    digest.update(path.read_bytes())
    return digest.hexdigest()


def _silent_tqdm():
    from tqdm.auto import tqdm

    class Silent(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


def fetch_hub(repo_id: str, commit: str, dest: Path, *, token: Any = None, endpoint: str | None = None,
              progress: bool = True) -> dict[str, dict]:
    """Download the engine's files of repo_id at commit into dest (resuming a killed download there) and check
    each against the hub's own record (LFS sha256 or git blob sha1). Returns {name: {size, sha256}}."""
    import huggingface_hub as hf

    token = secret_value(token)
    hide_secrets(token or hf.get_token())  # None: the client's own HF_TOKEN, hidden just the same
    try:
        hf.snapshot_download(repo_id, revision=commit, local_dir=str(dest), allow_patterns=ENGINE_FILES,
                             token=token, endpoint=endpoint, tqdm_class=None if progress else _silent_tqdm())
        if hasattr(hf, "get_cached_repo_tree"):
            tree = hf.get_cached_repo_tree(repo_id, revision=commit, local_dir=str(dest))
        else:  # older clients keep no tree cache: ask the hub
            tree = hf.HfApi(endpoint=endpoint, token=token).list_repo_tree(repo_id, revision=commit, recursive=True)
    except Exception as e:
        raise _hub_error(repo_id, commit, endpoint, e) from None
    shutil.rmtree(dest / ".cache", ignore_errors=True)  # the hub client's resume metadata
    names = list_files(dest)
    if not names:
        raise SourceError(f"hub {repo_id}@{commit}: no model files (config, tokenizer, safetensors) in the repo")
    files = hash_files(dest, names)
    expected = {f.path: f for f in tree if getattr(f, "blob_id", None) is not None}
    for name, entry in files.items():
        ref = expected.get(name)
        if ref is None:
            continue
        lfs = getattr(ref, "lfs", None)
        got, want = (entry["sha256"], lfs.sha256) if lfs is not None else (_git_blob_sha1(dest / name), ref.blob_id)
        if got != want:
            (dest / name).unlink()
            raise SourceError(f"hub {repo_id}@{commit}: {name} arrived with hash {got[:12]}..., "
                              f"the hub says {want[:12]}...; removed, retry the fetch")
    return files


# ---- S3 -------------------------------------------------------------------------------------------------------------
def fetch_s3(uri: str, dest: Path, opts=None, progress: bool = True) -> dict[str, dict]:
    """Download the engine's files under an s3:// prefix into dest. When the prefix carries a coldbrew manifest,
    every file is checked against it. Returns {name: {size, sha256}}."""
    import json

    from huggingface_hub.utils import filter_repo_objects

    from cache import remote

    s3 = remote.client(opts)
    listing = remote.list_dir(uri, opts, s3)
    names = {n: listing[n] for n in filter_repo_objects(sorted(listing), allow_patterns=ENGINE_FILES)}
    if not names:
        raise SourceError(f"{uri}: no model files (config, tokenizer, safetensors) under this prefix")
    remote.download_dir(uri, dest, names, opts, s3, progress)
    files = hash_files(dest, sorted(names))
    if MANIFEST in listing:
        want = json.loads(remote.read_text(remote.join_uri(uri, MANIFEST), opts, s3) or "{}").get("files", {})
        for name, entry in files.items():
            if name in want and want[name].get("sha256") != entry["sha256"]:
                raise SourceError(f"{uri}: {name} does not match the manifest stored beside it")
    return files


# ---- GGUF -----------------------------------------------------------------------------------------------------------
def gguf_revision(path: str, dtype: str) -> str:
    """Names one conversion: the dtype plus the file's size and mtime (hashing a multi-GB file each start is not)."""
    st = os.stat(path)
    return f"{dtype}-{st.st_size}-{st.st_mtime_ns}"


def fetch_gguf(path: str, dest: Path, dtype: str = "float32") -> dict[str, dict]:
    """Dequantize a GGUF file into dest as an HF-format directory (once: the result is a snapshot)."""
    from cache.gguf import write_hf_dir

    log.info("dequantizing %s to %s (once)", path, dtype)
    write_hf_dir(path, dest, dtype)
    return hash_files(dest, list_files(dest))
