"""S3 (and S3-compatible) transfer of whole directories: push a directory, pull one, list one, small
text objects.

Generic over directories (snapshots, packs, engine artifacts); bounded timeouts and retries, errors
without secrets.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cache.redact import hide_secrets, mask, secret_value

log = logging.getLogger(__name__)


class RemoteError(RuntimeError):
    """An S3 operation failed: the message names the endpoint, the object and the reason, never a
    credential."""


@dataclass(frozen=True)
class S3Options:
    """How to reach the store. None means boto3's own default chain (AWS_* variables, ~/.aws,
    instance role); timeouts and attempts bound how long an unreachable store can hold a start."""

    endpoint_url: str | None = None
    access_key_id: Any = None  # str or pydantic SecretStr
    secret_access_key: Any = None
    region: str | None = None
    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    max_attempts: int = 3
    workers: int = 8


def split_uri(uri: str) -> tuple[str, str]:
    """s3://bucket/prefix -> (bucket, "prefix") with no leading or trailing slash."""
    if not uri.startswith("s3://") or not uri[5:].split("/", 1)[0]:
        raise ValueError(f"S3 URI must look like s3://bucket/prefix, got {uri!r}")
    bucket, _, prefix = uri[5:].partition("/")
    return bucket, prefix.strip("/")


def join_uri(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts if p)])


def client(opts: S3Options | None = None):
    """A boto3 S3 client with bounded connect/read timeouts and standard-mode retries."""
    import boto3
    from botocore.config import Config

    opts = opts or S3Options()
    key_id, secret = secret_value(opts.access_key_id), secret_value(opts.secret_access_key)
    config = Config(
        connect_timeout=opts.connect_timeout,
        read_timeout=opts.read_timeout,
        retries={"max_attempts": opts.max_attempts, "mode": "standard"},
        max_pool_connections=max(10, opts.workers * 2),
    )
    session = boto3.session.Session(
        aws_access_key_id=key_id, aws_secret_access_key=secret, region_name=opts.region
    )
    s3 = session.client("s3", endpoint_url=opts.endpoint_url, config=config)
    # the chain's result, so keys taken from the environment are hidden too
    creds = session.get_credentials()
    frozen = creds.get_frozen_credentials() if creds is not None else None
    hide_secrets(
        key_id, secret, *((frozen.access_key, frozen.secret_key, frozen.token) if frozen else ())
    )
    return s3


def _error(op: str, uri: str, err: Exception, opts: S3Options | None) -> RemoteError:
    from botocore.exceptions import ClientError

    where = opts.endpoint_url if opts and opts.endpoint_url else "AWS S3"
    if isinstance(err, ClientError):
        code = err.response.get("Error", {}).get("Code", "?")
        reason = f"{code}: {err.response.get('Error', {}).get('Message', '')}".rstrip(": ")
    else:
        reason = f"{type(err).__name__}: {err}"
    return RemoteError(mask(f"S3 {op} {uri} at {where} failed: {reason}"))


def _is_missing(err: Exception) -> bool:
    from botocore.exceptions import ClientError

    return isinstance(err, ClientError) and err.response.get("Error", {}).get("Code") in (
        "404",
        "NoSuchKey",
        "NotFound",
    )


def read_text(uri: str, opts: S3Options | None = None, s3=None) -> str | None:
    """The text of one object, or None when it does not exist."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = split_uri(uri)
    try:
        return (s3 or client(opts)).get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    except (BotoCoreError, ClientError) as e:
        if _is_missing(e):
            return None
        raise _error("get", uri, e, opts) from None


def write_text(uri: str, text: str, opts: S3Options | None = None, s3=None) -> None:
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = split_uri(uri)
    try:
        (s3 or client(opts)).put_object(Bucket=bucket, Key=key, Body=text.encode())
    except (BotoCoreError, ClientError) as e:
        raise _error("put", uri, e, opts) from None


def list_dir(uri: str, opts: S3Options | None = None, s3=None) -> dict[str, int]:
    """{relative path: size} of every object under the prefix uri/."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, prefix = split_uri(uri)
    base = prefix + "/" if prefix else ""
    out: dict[str, int] = {}
    try:
        for page in (
            (s3 or client(opts))
            .get_paginator("list_objects_v2")
            .paginate(Bucket=bucket, Prefix=base)
        ):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(base) :]
                if rel and not rel.endswith("/"):
                    out[rel] = obj["Size"]
    except (BotoCoreError, ClientError) as e:
        raise _error("list", uri, e, opts) from None
    return out


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled)


def download_dir(
    uri: str,
    dest: str | os.PathLike,
    names: dict[str, int],
    opts: S3Options | None = None,
    s3=None,
    progress: bool = True,
) -> None:
    """Download the objects uri/<name> into dest/<name>, checking each one's size; several at a
    time."""
    from botocore.exceptions import BotoCoreError, ClientError

    s3 = s3 or client(opts)
    bucket, prefix = split_uri(uri)
    dest = Path(dest)
    bar = _progress(sum(names.values()), f"s3 pull {len(names)} files", progress)

    def one(name: str) -> None:
        if ".." in Path(name).parts:
            raise RemoteError(f"S3 object name {name!r} under {uri} escapes the directory")
        path = dest / name
        path.parent.mkdir(parents=True, exist_ok=True)
        key = f"{prefix}/{name}" if prefix else name
        try:
            s3.download_file(bucket, key, str(path), Callback=bar.update)
        except (BotoCoreError, ClientError) as e:
            raise _error("get", join_uri(uri, name), e, opts) from None
        if path.stat().st_size != names[name]:
            raise RemoteError(
                f"S3 get {join_uri(uri, name)}: {path.stat().st_size} bytes arrived, "
                f"{names[name]} expected"
            )

    try:
        with ThreadPoolExecutor(max_workers=(opts or S3Options()).workers) as pool:
            list(pool.map(one, sorted(names)))
    finally:
        bar.close()


def upload_dir(
    src: str | os.PathLike,
    uri: str,
    names: list[str],
    opts: S3Options | None = None,
    s3=None,
    progress: bool = True,
    last: str | None = None,
) -> None:
    """Upload src/<name> to uri/<name> for every name, several at a time; `last` goes up after all
    the others (the manifest: its presence marks the remote copy complete)."""
    from botocore.exceptions import BotoCoreError, ClientError

    s3 = s3 or client(opts)
    bucket, prefix = split_uri(uri)
    src = Path(src)
    bar = _progress(
        sum((src / n).stat().st_size for n in names), f"s3 push {len(names)} files", progress
    )

    def one(name: str) -> None:
        key = f"{prefix}/{name}" if prefix else name
        try:
            s3.upload_file(str(src / name), bucket, key, Callback=bar.update)
        except (BotoCoreError, ClientError) as e:
            raise _error("put", join_uri(uri, name), e, opts) from None

    try:
        with ThreadPoolExecutor(max_workers=(opts or S3Options()).workers) as pool:
            list(pool.map(one, [n for n in names if n != last]))
        if last is not None:
            one(last)
    finally:
        bar.close()


def push_dir(
    src: str | os.PathLike,
    uri: str,
    opts: S3Options | None = None,
    *,
    manifest: dict | None = None,
    progress: bool = True,
) -> dict:
    """Upload a directory to uri/ with its manifest going up last, so a reader never takes a
    half-pushed copy as complete. The manifest is the directory's own (coldbrew-manifest.json) or
    one computed now."""
    import json

    from cache.snapshot import MANIFEST, build_manifest, read_manifest

    src = Path(src)
    if manifest is None:
        try:
            manifest = read_manifest(src)
        except ValueError:
            manifest = build_manifest(
                src, source=str(src.resolve()), kind="local", key=src.name, revision="local"
            )
    s3 = client(opts)
    upload_dir(src, uri, sorted(manifest["files"]), opts, s3, progress)
    write_text(join_uri(uri, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True), opts, s3)
    log.info("pushed %s to %s (%d files)", src, uri, len(manifest["files"]))
    return manifest


def read_manifest_at(uri: str, opts: S3Options | None = None, s3=None) -> dict | None:
    """The manifest of a pushed directory, or None when uri holds no complete push."""
    import json

    from cache.snapshot import MANIFEST

    text = read_text(join_uri(uri, MANIFEST), opts, s3)
    if text is None:
        return None
    try:
        manifest = json.loads(text)
        assert isinstance(manifest.get("files"), dict) and manifest["files"]
    except (ValueError, AssertionError, AttributeError):
        raise RemoteError(f"{join_uri(uri, MANIFEST)}: malformed manifest") from None
    return manifest


def pull_dir(
    uri: str,
    dest: str | os.PathLike,
    opts: S3Options | None = None,
    *,
    verify: str = "size",
    progress: bool = True,
    manifest: dict | None = None,
    s3=None,
) -> dict | None:
    """Download a directory pushed with push_dir into dest (files, then its manifest), checking
    sizes and, with verify="full", every sha256. Returns the manifest, or None when uri holds no
    complete push."""
    import json

    from cache.snapshot import MANIFEST, hash_files

    s3 = s3 or client(opts)
    manifest = manifest or read_manifest_at(uri, opts, s3)
    if manifest is None:
        return None
    files = manifest["files"]
    download_dir(
        uri, dest, {name: entry["size"] for name, entry in files.items()}, opts, s3, progress
    )
    if verify == "full":
        for name, entry in hash_files(Path(dest), sorted(files)).items():
            if entry["sha256"] != files[name]["sha256"]:
                raise RemoteError(
                    f"S3 get {join_uri(uri, name)}: sha256 does not match the manifest"
                )
    (Path(dest) / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest
