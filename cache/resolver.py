"""The lookup order from a model reference to a local snapshot: image, network volume, remote cache,
the source.

A snapshot fetched from the source is published to the local cache (and pushed to the remote cache
when asked).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("cache")

DEFAULT_BASE_PATH = "/runpod-volume"


def default_cache_dir(
    cache_dir: str | os.PathLike | None, base_path: str | os.PathLike | None
) -> Path:
    """cache_dir, else <base_path>/coldbrew-cache when the volume is mounted, else
    ~/.cache/coldbrew."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if base_path and os.path.isdir(base_path):
        return Path(base_path) / "coldbrew-cache"
    return Path("~/.cache/coldbrew").expanduser()


def make_s3_options(
    s3_options=None,
    *,
    s3_endpoint_url=None,
    aws_access_key_id=None,
    aws_secret_access_key=None,
    aws_region=None,
):
    """S3Options from an explicit object and/or the handler's flat settings (the flat values win
    when set)."""
    from dataclasses import replace

    from cache.remote import S3Options

    opts = s3_options or S3Options()
    flat = dict(
        endpoint_url=s3_endpoint_url,
        access_key_id=aws_access_key_id,
        secret_access_key=aws_secret_access_key,
        region=aws_region,
    )
    return replace(opts, **{k: v for k, v in flat.items() if v is not None})


def _find_baked(baked_dir: str | os.PathLike, src, revision: str, verify: str) -> Path | None:
    """A snapshot baked into the image: baked_dir is a cache root (snapshots/...) or one snapshot
    directory."""
    from cache.snapshot import SnapshotStore, check_snapshot, read_manifest

    root = Path(baked_dir)
    if (root / "snapshots").is_dir():
        store = SnapshotStore(root)
        for rev in dict.fromkeys(r for r in (revision, store.read_ref(src.key, revision)) if r):
            path = store.path(src.key, rev)
            if path.exists():
                reason = check_snapshot(path, verify)
                if reason is None:
                    return path
                log.warning("snapshot baked into the image at %s is not usable (%s)", path, reason)
        return None
    try:
        manifest = read_manifest(root)
    except ValueError:
        return None
    if manifest.get("key") != src.key or revision not in (
        manifest.get("revision"),
        manifest.get("requested_revision"),
    ):
        return None
    reason = check_snapshot(root, verify)
    if reason is not None:
        log.warning("snapshot baked into the image at %s is not usable (%s)", root, reason)
        return None
    return root


def _from_remote(
    store, src, revision: str, remote: str, opts, verify: str, progress: bool
) -> Path | None:
    """Pull (key, revision or the commit its remote ref names) from the fleet cache; None when it is
    not there."""
    from cache import remote as s3
    from cache.snapshot import ref_relpath, snapshot_relpath
    from cache.sources import is_commit

    client = s3.client(opts)
    pinned = revision
    if src.kind == "hub" and not is_commit(revision):
        text = s3.read_text(s3.join_uri(remote, ref_relpath(src.key, revision)), opts, client)
        if not text:
            return None
        pinned = text.strip()
    uri = s3.join_uri(remote, snapshot_relpath(src.key, pinned))
    manifest = s3.read_manifest_at(uri, opts, client)
    if manifest is None:
        return None
    path = store.publish(
        src.key,
        pinned,
        lambda dest: s3.pull_dir(
            uri, dest, opts, verify=verify, progress=progress, manifest=manifest, s3=client
        ),
        verify=verify,
    )
    if pinned != revision:
        store.write_ref(src.key, revision, pinned)
    return path


def push_snapshot(path: str | os.PathLike, remote: str, opts=None, progress: bool = True) -> str:
    """Push a published snapshot into the fleet cache layout (remote/snapshots/<key>/<revision>/,
    plus the ref of the branch or tag it was fetched for). Returns the snapshot's URI."""
    from cache import remote as s3
    from cache.snapshot import read_manifest, ref_relpath, snapshot_relpath

    manifest = read_manifest(Path(path))
    uri = s3.join_uri(remote, snapshot_relpath(manifest["key"], manifest["revision"]))
    client = s3.client(opts)
    s3.push_dir(path, uri, opts, manifest=manifest, progress=progress)
    requested = manifest.get("requested_revision")
    if requested and requested != manifest["revision"]:
        s3.write_text(
            s3.join_uri(remote, ref_relpath(manifest["key"], requested)),
            manifest["revision"],
            opts,
            client,
        )
    return uri


def resolve(
    ref: str,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    baked_dir: str | os.PathLike | None = None,
    base_path: str | os.PathLike | None = DEFAULT_BASE_PATH,
    remote: str | None = None,
    push: bool = False,
    remote_fallback: bool = True,
    token: Any = None,
    endpoint: str | None = None,
    s3_options=None,
    s3_endpoint_url: str | None = None,
    aws_access_key_id: Any = None,
    aws_secret_access_key: Any = None,
    aws_region: str | None = None,
    verify: str = "size",
    refresh: bool = False,
    progress: bool = True,
    gguf_dtype: str = "float32",
    check_config: Callable[[dict], Any] | None = None,
) -> Path:
    """A model reference -> the path of a complete, verified local snapshot (config, tokenizer,
    safetensors).

    ref: a hub repo id (org/name), s3://bucket/prefix, a local directory (used in place) or a .gguf
    file.
    Lookup order: baked_dir (a cache root or snapshot baked into the image), the network volume (the
    RunPod cached-model layout under base_path, then cache_dir), the remote fleet cache (`remote`,
    s3://...), then the source itself; what comes from the source is published to cache_dir and,
    with push=True, pushed to `remote`. A branch or tag once fetched is pinned locally to its commit
    (refresh=True asks the hub again); an s3:// source prefix is taken as immutable (`revision` is
    then only a label, default "default").
    token / endpoint: the hub's (None: huggingface_hub's own HF_TOKEN / HF_ENDPOINT). The S3
    settings (None: boto3's own chain) serve both s3:// sources and the remote cache. verify: "size"
    (always) or "full" (sha256 of every file). remote_fallback: an unreachable remote cache falls
    back to the source with one warning instead of failing.
    check_config: called with config.json of a model about to be fetched from the hub or S3, before
    any weight file; a ValueError it raises refuses the model (a SourceError with its message).
    """
    from cache import sources
    from cache.remote import RemoteError
    from cache.snapshot import VERIFY_MODES, SnapshotStore

    if verify not in VERIFY_MODES:
        raise ValueError(f"verify: must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
    if remote is not None and not str(remote).startswith("s3://"):
        raise ValueError(f"remote: must look like s3://bucket/prefix, got {remote!r}")
    src = sources.parse(ref)
    if src.kind == "local":
        return sources.open_local(src.location, verify)
    opts = make_s3_options(
        s3_options,
        s3_endpoint_url=s3_endpoint_url,
        aws_access_key_id=aws_access_key_id,
        aws_secret_access_key=aws_secret_access_key,
        aws_region=aws_region,
    )
    store = SnapshotStore(default_cache_dir(cache_dir, base_path))
    if src.kind == "gguf":
        wanted = sources.gguf_revision(src.location, gguf_dtype)
    elif src.kind == "hub":
        wanted = revision or "main"
    else:
        wanted = revision or "default"

    def found(where: str, path: Path) -> Path:
        log.info("model %s (revision %s): %s -> %s", src.display, wanted, where, path)
        return path

    if baked_dir and (path := _find_baked(baked_dir, src, wanted, verify)) is not None:
        return found("baked into the image", path)
    if (
        src.kind == "hub"
        and (path := sources.find_runpod_cached(base_path, src.location, revision)) is not None
    ):
        return found("RunPod cached model", path)
    if (not refresh or sources.is_commit(wanted)) and (
        path := store.find(src.key, wanted, verify)
    ) is not None:
        return found("local cache", path)
    if remote:
        try:
            path = _from_remote(store, src, wanted, remote, opts, verify, progress)
        except RemoteError as e:
            if not remote_fallback:
                raise
            log.warning("remote cache unusable, fetching from the source instead: %s", e)
            path = None
        if path is not None:
            return found("remote cache", path)

    if src.kind == "hub":
        from cache import hub

        pinned = hub.hub_commit(src.location, revision, token=token, endpoint=endpoint)

        def build(dest: Path) -> dict[str, dict]:
            return hub.fetch_hub(
                src.location,
                pinned,
                dest,
                token=token,
                endpoint=endpoint,
                progress=progress,
                check_config=check_config,
            )
    elif src.kind == "s3":
        pinned = wanted

        def build(dest: Path) -> dict[str, dict]:
            return sources.fetch_s3(src.location, dest, opts, progress, check_config)
    else:
        pinned = wanted

        def build(dest: Path) -> dict[str, dict]:
            return sources.fetch_gguf(src.location, dest, gguf_dtype)

    def build_snapshot(dest: Path) -> dict:
        from cache.snapshot import build_manifest

        return build_manifest(
            dest,
            source=src.display,
            kind=src.kind,
            key=src.key,
            revision=pinned,
            requested_revision=wanted if src.kind == "hub" else revision,
            files=build(dest),
        )

    path = store.publish(src.key, pinned, build_snapshot, verify=verify, resume=src.kind == "hub")
    if pinned != wanted:
        store.write_ref(src.key, wanted, pinned)
    if push and remote:
        try:
            push_snapshot(path, remote, opts, progress)
        except RemoteError as e:
            log.warning("could not push the snapshot to the remote cache: %s", e)
    return found("source", path)
