"""`python -m cache fetch|push|pull|ls`: fetch a model into the snapshot cache, share snapshots over
S3, list them.

Credentials come from the clients' own environment (HF_TOKEN, AWS_*); they are never printed or
logged.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _s3_opts(args):
    from cache.remote import S3Options

    return S3Options(
        endpoint_url=args.s3_endpoint_url,
        region=args.aws_region,
        connect_timeout=args.s3_timeout,
        read_timeout=args.s3_read_timeout,
        max_attempts=args.s3_attempts,
    )


def _fetch(args) -> None:
    from cache import resolve

    path = resolve(
        args.model,
        revision=args.revision,
        cache_dir=args.cache_dir,
        baked_dir=args.baked_dir,
        base_path=args.base_path,
        remote=args.remote,
        push=args.push,
        endpoint=args.hf_endpoint,
        s3_options=_s3_opts(args),
        verify=args.verify,
        refresh=args.refresh,
        progress=not args.quiet,
    )
    print(path)


def _push(args) -> None:
    from cache import remote
    from cache.resolver import push_snapshot
    from cache.snapshot import read_manifest

    src = Path(args.snapshot)
    if not src.is_dir():
        raise SystemExit(f"push: {src} is not a directory")
    try:
        manifest = read_manifest(src)
    except ValueError:
        manifest = None
    if manifest is not None and manifest.get("key") and not args.exact:
        print(push_snapshot(src, args.uri, _s3_opts(args), progress=not args.quiet))
    else:
        remote.push_dir(src, args.uri, _s3_opts(args), progress=not args.quiet)
        print(args.uri.rstrip("/"))


def _pull(args) -> None:
    from cache import remote
    from cache.resolver import default_cache_dir
    from cache.snapshot import SnapshotStore

    opts = _s3_opts(args)
    manifest = remote.read_manifest_at(args.uri, opts)
    if manifest is None:
        raise SystemExit(
            f"pull: {args.uri.rstrip('/')}/coldbrew-manifest.json not found "
            "(nothing complete there)"
        )
    if args.dest:
        Path(args.dest).mkdir(parents=True, exist_ok=True)
        remote.pull_dir(
            args.uri,
            args.dest,
            opts,
            verify=args.verify,
            progress=not args.quiet,
            manifest=manifest,
        )
        print(Path(args.dest))
        return
    if not manifest.get("key") or not manifest.get("revision"):
        raise SystemExit(
            "pull: this push is not a coldbrew snapshot (no key/revision in its manifest); "
            "use --dest"
        )
    store = SnapshotStore(default_cache_dir(args.cache_dir, args.base_path))
    path = store.publish(
        manifest["key"],
        manifest["revision"],
        lambda dest: remote.pull_dir(
            args.uri, dest, opts, verify=args.verify, progress=not args.quiet, manifest=manifest
        ),
        verify=args.verify,
    )
    requested = manifest.get("requested_revision")
    if (
        requested
        and requested != manifest["revision"]
        and store.read_ref(manifest["key"], requested) is None
    ):
        store.write_ref(manifest["key"], requested, manifest["revision"])
    print(path)


def _ls(args) -> None:
    from cache.resolver import default_cache_dir
    from cache.snapshot import SnapshotStore, check_snapshot

    store = SnapshotStore(default_cache_dir(args.cache_dir, args.base_path))
    rows = []
    for path, manifest in store.entries():
        if manifest is None:
            rows.append(("?", "?", "-", "corrupt", str(path)))
            continue
        size = sum(f["size"] for f in manifest["files"].values())
        state = "ok" if check_snapshot(path, args.verify) is None else "corrupt"
        rows.append(
            (
                manifest.get("source", "?"),
                manifest.get("revision", "?"),
                _human(size),
                state,
                str(path),
            )
        )
    print(f"cache: {store.root}")
    if not rows:
        print("(no snapshots)")
        return
    header = ("SOURCE", "REVISION", "SIZE", "STATE", "PATH")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4])
    total = sum(sum(f["size"] for f in m["files"].values()) for _, m in store.entries() if m)
    print(f"{len(rows)} snapshots, {_human(total)}")
    staging = (
        list((store.root / ".staging").glob("*")) if (store.root / ".staging").is_dir() else []
    )
    quarantined = (
        list((store.root / ".quarantine").glob("*"))
        if (store.root / ".quarantine").is_dir()
        else []
    )
    if staging or quarantined:
        print(
            f"{len(staging)} unfinished builds in .staging, "
            f"{len(quarantined)} damaged snapshots in .quarantine"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cache", description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--cache-dir",
        help="cache root (default: BASE_PATH/coldbrew-cache if mounted, else ~/.cache/coldbrew)",
    )
    common.add_argument(
        "--base-path", default="/runpod-volume", help="network volume (default /runpod-volume)"
    )
    common.add_argument(
        "--s3-endpoint-url",
        help="S3-compatible endpoint (default: AWS, or boto3's AWS_ENDPOINT_URL)",
    )
    common.add_argument("--aws-region")
    common.add_argument(
        "--s3-timeout", type=float, default=5.0, help="S3 connect timeout in seconds (default 5)"
    )
    common.add_argument(
        "--s3-read-timeout",
        type=float,
        default=30.0,
        help="S3 read timeout in seconds (default 30)",
    )
    common.add_argument(
        "--s3-attempts", type=int, default=3, help="S3 attempts per request (default 3)"
    )
    common.add_argument(
        "--verify",
        choices=["size", "full"],
        default="size",
        help="size: check file sizes; full: also every sha256",
    )
    common.add_argument("--quiet", action="store_true", help="no progress bars")
    common.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = ap.add_subparsers(dest="command", required=True)

    fetch = sub.add_parser(
        "fetch", parents=[common], help="resolve MODEL to a local snapshot and print its path"
    )
    fetch.add_argument(
        "model", help="hub repo id, s3://bucket/prefix, local directory or .gguf file"
    )
    fetch.add_argument("--revision", help="hub branch, tag or commit (default main)")
    fetch.add_argument(
        "--baked-dir", help="a cache root or snapshot baked into the image, looked at first"
    )
    fetch.add_argument(
        "--remote", help="s3://bucket/prefix of the fleet cache, looked at before the source"
    )
    fetch.add_argument(
        "--push", action="store_true", help="push what came from the source to --remote"
    )
    fetch.add_argument(
        "--hf-endpoint", help="hub endpoint (default: huggingface_hub's HF_ENDPOINT)"
    )
    fetch.add_argument(
        "--refresh", action="store_true", help="ask the hub what a branch points at now"
    )
    fetch.set_defaults(run=_fetch)

    push = sub.add_parser(
        "push", parents=[common], help="upload a snapshot (or any directory) to S3"
    )
    push.add_argument("snapshot")
    push.add_argument(
        "uri", help="s3://bucket/prefix: a snapshot goes to URI/snapshots/<key>/<revision>/"
    )
    push.add_argument(
        "--exact", action="store_true", help="upload to URI itself, not the cache layout under it"
    )
    push.set_defaults(run=_push)

    pull = sub.add_parser(
        "pull", parents=[common], help="download a pushed snapshot into the cache"
    )
    pull.add_argument("uri", help="s3://... of a pushed snapshot (the URI push printed)")
    pull.add_argument("--dest", help="download into this directory instead of the cache")
    pull.set_defaults(run=_pull)

    ls = sub.add_parser("ls", parents=[common], help="list cached snapshots with sizes")
    ls.set_defaults(run=_ls)

    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        for noisy in (
            "botocore",
            "boto3",
            "s3transfer",
            "urllib3",
            "httpx",
            "httpcore",
            "filelock",
        ):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    from cache.remote import RemoteError
    from cache.sources import SourceError

    try:
        args.run(args)
    except (RemoteError, SourceError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
