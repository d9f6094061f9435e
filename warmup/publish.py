"""Publishing a compiled-engine artifact for the fleet, once: on a shared directory (a network
volume) and on S3.

Locally a staged directory is fsynced and renamed into `<root>/<id>` under a cross-process file
lock, as cache.snapshot publishes snapshots, so a reader never sees half an artifact and two
publishers leave one. On S3 the files go up first and the manifest last, written only if none is
there (a conditional put): the first complete push wins and a second publisher's identical files
change nothing. stage_from_cache() turns kernels a worker compiled (entries of its Triton cache)
into a staged artifact.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

from warmup.artifacts import ARTIFACT_FILE, ENGINES_DIR, TRITON_DIR, key_id

log = logging.getLogger(__name__)

LOCKS_DIR = ".locks"
GROUP_PREFIX = "__grp__"


def staging_dir(root: str, prefix: str) -> str:
    """A fresh directory under root (same filesystem, so the publish is a rename); its name starts
    with a dot, which finding artifacts skips."""
    os.makedirs(root, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{prefix}-", dir=root)


def portable_groups(triton_dir: str) -> None:
    """Triton's group files list their entry's files by absolute path: keep the file names only, so
    the bytes do not depend on where a kernel was compiled (install() points them at where they are
    installed)."""
    for group_path in Path(triton_dir).glob(f"*/{GROUP_PREFIX}*.json"):
        group = json.loads(group_path.read_text())
        group["child_paths"] = {
            name: os.path.basename(path) for name, path in group.get("child_paths", {}).items()
        }
        group_path.write_text(json.dumps(group, sort_keys=True))


def write_artifact_file(staging: str, key: dict, record: dict) -> None:
    with open(os.path.join(staging, ARTIFACT_FILE), "w") as f:
        json.dump({"key": key, "record": record}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def publish_local(staging: str, root: str, key: dict, *, replace: bool) -> tuple[str, bool]:
    """Move the staged artifact to root/<id> under root's lock for that id -> (its path, whether
    this call put it there). replace=False keeps an artifact already published (the staging is
    removed): a rebuild passes True."""
    from cache.snapshot import fsync_tree

    final = os.path.join(root, key_id(key))
    os.makedirs(os.path.join(root, LOCKS_DIR), exist_ok=True)
    # the kernel drops it if we die
    with FileLock(os.path.join(root, LOCKS_DIR, f"{key_id(key)}.lock")):
        if os.path.isfile(os.path.join(final, ARTIFACT_FILE)) and not replace:
            shutil.rmtree(staging, ignore_errors=True)
            return final, False
        fsync_tree(Path(staging))
        old = None
        if os.path.exists(final):  # moved aside, so the rename below replaces it in one step
            old = staging_dir(root, "replaced")
            os.replace(final, os.path.join(old, "artifact"))
        os.replace(staging, final)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return final, True


def publish_remote(artifact: str, remote: str, key: dict, opts=None) -> bool:
    """Push the artifact to remote/engines/<id> unless one is there -> whether this call published
    it. The files go up first; the manifest, which marks a push complete, is written only if absent
    (S3's If-None-Match), so of two publishers racing only one manifest lands. Raises
    cache.remote.RemoteError."""
    from botocore.exceptions import BotoCoreError, ClientError

    from cache import remote as s3
    from cache.snapshot import MANIFEST, build_manifest

    uri = s3.join_uri(remote, ENGINES_DIR, key_id(key))
    client = s3.client(opts)
    if s3.read_manifest_at(uri, opts, client) is not None:
        return False
    manifest = build_manifest(
        Path(artifact), source="a coldbrew worker", kind="engine", key=key_id(key), revision="local"
    )
    s3.upload_dir(artifact, uri, sorted(manifest["files"]), opts, client, progress=False)
    bucket, name = s3.split_uri(s3.join_uri(uri, MANIFEST))
    body = json.dumps(manifest, indent=1, sort_keys=True).encode()
    try:
        client.put_object(Bucket=bucket, Key=name, Body=body, IfNoneMatch="*")
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code")
        if code in ("PreconditionFailed", "ConditionalRequestConflict"):
            return False  # another publisher's manifest landed
        if code != "NotImplemented":
            raise s3.RemoteError(f"S3 put {s3.join_uri(uri, MANIFEST)}: {code}") from None
        log.info(
            "publish: %s has no conditional writes; writing the manifest unconditionally", remote
        )
        s3.write_text(s3.join_uri(uri, MANIFEST), body.decode(), opts, client)
    except BotoCoreError as e:
        raise s3.RemoteError(f"S3 put {s3.join_uri(uri, MANIFEST)}: {type(e).__name__}") from None
    log.info("publish: pushed compiled engine %s to %s", key_id(key), uri)
    return True


def stage_from_cache(
    triton_cache: str, entries: list[str], key: dict, record: dict, root: str
) -> str:
    """A staged artifact under root holding the given entries of a Triton cache (those complete:
    with their group file) and artifact.json with `key` and `record` ("kernels", entry -> kernel
    name, set here)."""
    staging = staging_dir(root, "publish")
    dest = os.path.join(staging, TRITON_DIR)
    os.makedirs(dest)
    kernels = {}
    for entry in sorted(set(entries)):
        src = os.path.join(triton_cache, entry)
        groups = [n for n in _names(src) if n.startswith(GROUP_PREFIX) and n.endswith(".json")]
        if not groups:
            continue  # absent, or a compile still writing it
        shutil.copytree(src, os.path.join(dest, entry))
        kernels[entry] = groups[0][len(GROUP_PREFIX) : -len(".json")]
    # the C modules Triton builds with gcc at a process's first launches (its driver utilities and
    # one launcher per kernel signature, each keyed by its source): without them the next worker
    # builds each again, a few tenths of a second apiece, inside its first request
    for entry in module_entries(triton_cache):
        if not os.path.exists(os.path.join(dest, entry)):
            shutil.copytree(os.path.join(triton_cache, entry), os.path.join(dest, entry))
    portable_groups(dest)
    write_artifact_file(staging, key, {**record, "kernels": kernels})
    return staging


def module_entries(triton_cache: str) -> list[str]:
    """The entries of a Triton cache that hold a built C module (`cuda_utils*.so`,
    `__triton_launcher*.so`: one file each, written whole by Triton's cache manager)."""
    return sorted(
        entry
        for entry in _names(triton_cache)
        if any(n.endswith(".so") for n in _names(os.path.join(triton_cache, entry)))
    )


def _names(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
