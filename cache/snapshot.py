"""Immutable local snapshots: the manifest (sizes, sha256), verification, quarantine, and atomic
publishing.

A cache root holds `snapshots/<key>/<revision>/`; builds happen in `.staging/` under a cross-process
lock.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

if TYPE_CHECKING:
    from filelock import FileLock


log = logging.getLogger(__name__)

MANIFEST = "coldbrew-manifest.json"
MANIFEST_FORMAT = 1
VERIFY_MODES = ("size", "full")
_HASH_CHUNK = 8 << 20


def coldbrew_version() -> str:
    """The installed coldbrew version (pyproject's, read from the source tree when not
    installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("coldbrew")
    except PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        found = (
            re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M)
            if pyproject.exists()
            else None
        )
        return found.group(1) if found else "unknown"


def hash_file(path: Path, git_blob: bool = False) -> dict:
    """{"size", "sha256"} of one file read once, in chunks; git_blob adds "git_sha1", its git blob
    id (what the hub lists for a file not in LFS), from the same read."""
    size = os.stat(path).st_size
    sha256 = hashlib.sha256()
    git_sha1 = hashlib.sha1(b"blob %d\0" % size) if git_blob else None
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            sha256.update(chunk)
            if git_sha1 is not None:
                git_sha1.update(chunk)
    out = {"size": size, "sha256": sha256.hexdigest()}
    if git_sha1 is not None:
        out["git_sha1"] = git_sha1.hexdigest()
    return out


def list_files(root: Path) -> list[str]:
    """Relative POSIX paths of the regular files under root, sorted, leaving out the manifest and
    dot-dirs."""
    out = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if rel.as_posix() == MANIFEST or any(part.startswith(".") for part in rel.parts):
            continue
        if path.is_file():
            out.append(rel.as_posix())
    return sorted(out)


def hash_files(root: Path, names: list[str], workers: int = 8) -> dict[str, dict]:
    """{name: {"size", "sha256"}} of files under root, hashed on several threads (hashlib releases
    the GIL)."""

    def one(name: str) -> tuple[str, dict]:
        return name, hash_file(root / name)

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(names)))) as pool:
        return dict(pool.map(one, names))


def build_manifest(
    root: Path,
    *,
    source: str,
    kind: str,
    key: str,
    revision: str,
    requested_revision: str | None = None,
    files: dict[str, dict] | None = None,
) -> dict:
    """The manifest of the directory root as it is now (every file's size and sha256)."""
    return {
        "format": MANIFEST_FORMAT,
        "coldbrew_version": coldbrew_version(),
        "source": source,
        "kind": kind,
        "key": key,
        "revision": revision,
        "requested_revision": requested_revision,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "files": files if files is not None else hash_files(root, list_files(root)),
    }


def read_manifest(root: Path) -> dict:
    """The manifest of a snapshot directory; ValueError saying what is wrong when missing or
    malformed."""
    path = Path(root) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"no {MANIFEST}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"unreadable {MANIFEST} ({type(e).__name__})") from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or not files or data.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"malformed {MANIFEST}")
    for name, entry in files.items():
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("size"), int)
            or not isinstance(entry.get("sha256"), str)
            or ".." in Path(name).parts
            or name.startswith("/")
        ):
            raise ValueError(f"malformed {MANIFEST} entry {name!r}")
    return data


def check_snapshot(root: Path, verify: str = "size") -> str | None:
    """None when the snapshot at root is complete and intact, else the reason it is not.

    Sizes are always checked; verify="full" also recomputes every sha256."""
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
    root = Path(root)
    if not root.is_dir():
        return "missing"
    try:
        files = read_manifest(root)["files"]
    except ValueError as e:
        return str(e)
    for name, entry in files.items():
        try:
            size = (root / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if size != entry["size"]:
            return f"{name} has {size} bytes, the manifest says {entry['size']}"
    if verify == "full":
        for name, entry in hash_files(root, sorted(files)).items():
            if entry["sha256"] != files[name]["sha256"]:
                return (
                    f"{name} sha256 {entry['sha256'][:12]}... "
                    f"!= manifest {files[name]['sha256'][:12]}..."
                )
    return None


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under root, then root itself."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _safe(name: str) -> str:
    """A string usable as one path component (revision names may hold '/')."""
    return quote(name, safe="-_.@+")


def snapshot_relpath(key: str, revision: str) -> str:
    """Where (key, revision) lives under a cache root, local or remote."""
    return f"snapshots/{_safe(key)}/{_safe(revision)}"


def ref_relpath(key: str, name: str) -> str:
    """Where the ref `name` (a branch or tag) of key lives under a cache root, local or remote."""
    return f"refs/{_safe(key)}/{_safe(name)}"


class SnapshotStore:
    """A cache root: published snapshots, revision refs, locks, staging and quarantine
    directories."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser()

    def path(self, key: str, revision: str) -> Path:
        return self.root / snapshot_relpath(key, revision)

    # ---- refs: a branch or tag name -> the pinned revision it was fetched at ---------------------
    def read_ref(self, key: str, name: str) -> str | None:
        try:
            return (self.root / ref_relpath(key, name)).read_text().strip() or None
        except OSError:
            return None

    def write_ref(self, key: str, name: str, revision: str) -> None:
        path = self.root / ref_relpath(key, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(revision)
        os.replace(tmp, path)

    def find(self, key: str, revision: str, verify: str = "size") -> Path | None:
        """The published snapshot of (key, revision or a ref naming it) when it is intact, else
        None."""
        for rev in dict.fromkeys([revision, self.read_ref(key, revision)]):
            if rev and check_snapshot(self.path(key, rev), verify) is None:
                return self.path(key, rev)
        return None

    def lock(self, key: str, revision: str) -> FileLock:
        """The build's lock of (key, revision); a start that finds its snapshot never imports
        filelock."""
        from filelock import FileLock

        path = self.root / ".locks" / f"{_safe(key)}@{_safe(revision)}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        return FileLock(str(path))

    def quarantine(self, path: Path, reason: str) -> Path:
        """Move a bad snapshot aside (never deleted, for a post-mortem) and say so in one log
        line."""
        stamp = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        dest = self.root / ".quarantine" / f"{path.parent.name}@{path.name}-{stamp}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest)
        log.warning("snapshot %s is corrupt (%s): moved to %s; rebuilding it", path, reason, dest)
        return dest

    def publish(
        self,
        key: str,
        revision: str,
        build: Callable[[Path], dict],
        *,
        verify: str = "size",
        resume: bool = False,
    ) -> Path:
        """The intact snapshot of (key, revision), building it with `build(staging_dir) -> manifest`
        when needed.

        Only one process builds at a time (a file lock); the others wait and then find it published.
        The build writes into a staging directory on the same filesystem, which is fsynced and
        renamed into place, so a process killed mid-build leaves nothing that looks published.
        `resume` keeps a killed build's staging files (the hub client keeps what a killed download
        completed)."""
        final = self.path(key, revision)
        if check_snapshot(final, verify) is None:
            return final
        from filelock import Timeout

        lock = self.lock(key, revision)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            log.info("waiting for another process to finish building %s", final)
            lock.acquire()
        try:  # the kernel drops the lock if this process dies
            return self._build_locked(key, revision, final, build, verify, resume)
        finally:
            lock.release()

    def _build_locked(
        self,
        key: str,
        revision: str,
        final: Path,
        build: Callable[[Path], dict],
        verify: str,
        resume: bool,
    ) -> Path:
        reason = check_snapshot(final, verify)
        if reason is None:
            return final
        if final.exists():
            self.quarantine(final, reason)
        staging = self.root / ".staging" / f"{_safe(key)}@{_safe(revision)}"
        if staging.exists() and not resume:
            shutil.rmtree(staging)
        staging.mkdir(parents=True, exist_ok=True)
        manifest = build(staging)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        fsync_tree(staging)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, final)
        _fsync_dir(final.parent)
        log.info(
            "published snapshot %s (%d files, %.1f MB)",
            final,
            len(manifest["files"]),
            sum(f["size"] for f in manifest["files"].values()) / 1e6,
        )
        return final

    def entries(self) -> list[tuple[Path, dict | None]]:
        """Every published snapshot directory with its manifest (None when unreadable)."""
        out = []
        for path in sorted((self.root / "snapshots").glob("*/*")):
            try:
                out.append((path, read_manifest(path)))
            except ValueError:
                out.append((path, None))
        return out
