"""The start path's own files: which pages of the libraries and modules a worker's start used,
recorded once, so a cold start reads them in a few large reads before the weights instead of
`import torch` faulting them in one small read at a time behind the weight stream (what that is
worth: docs/cold-start.md, from bench/results/2026-11-22-h100-cold-start-start-pages.json).

record(path): the files this process maps (/proc/self/maps: torch's and CUDA's shared libraries) and
imported (sys.modules), each with its pages now in the page cache (mincore), merged into ranges.
read(path): those ranges into the page cache, in order. Stdlib only.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from cache.prefetch import page_residency

log = logging.getLogger(__name__)

# resident runs closer than this are read as one range (a read is cheaper than a seek)
GAP_BYTES = 1 << 20
READ_BYTES = 8 << 20
FORMAT = 1


def default_path(cache_dir: str) -> str:
    """One record per interpreter and environment (a different venv maps different files)."""
    key = hashlib.sha256(f"{sys.executable}\0{sys.version}\0{sys.prefix}".encode()).hexdigest()[:16]
    return os.path.join(cache_dir, "start-pages", f"{key}.json")


def start_files() -> list[str]:
    """Mapped regular files first (in load order), then imported modules' files and their
    bytecode."""
    out: dict[str, None] = {}
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    out.setdefault(parts[5].strip(), None)
    except OSError:
        pass
    for mod in list(sys.modules.values()):
        path = getattr(mod, "__file__", None)
        if not path:
            continue
        out.setdefault(path, None)
        if path.endswith(".py"):
            try:
                out.setdefault(importlib.util.cache_from_source(path), None)
            except (NotImplementedError, ValueError):
                pass
    return [p for p in out if os.path.isfile(p)]


def _ranges(vec: bytes, page: int) -> list[list[int]]:
    """Resident pages -> [offset, length] runs, merged across gaps under GAP_BYTES."""
    out: list[list[int]] = []
    i, n = 0, len(vec)
    while i < n:
        if not vec[i] & 1:
            i += 1
            continue
        j = i
        while j < n and vec[j] & 1:
            j += 1
        start, end = i * page, j * page
        if out and start - (out[-1][0] + out[-1][1]) < GAP_BYTES:
            out[-1][1] = end - out[-1][0]
        else:
            out.append([start, end - start])
        i = j
    return out


def record(path: str) -> int:
    """Write the start path's resident ranges to `path` (atomically); returns the bytes they
    cover."""
    page = os.sysconf("SC_PAGE_SIZE")
    files = []
    total = 0
    for f in start_files():
        vec = page_residency(f)
        if not vec:
            continue
        ranges = _ranges(vec, page)
        if ranges:
            files.append([f, ranges])
            total += sum(n for _, n in ranges)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as out:
        json.dump({"format": FORMAT, "bytes": total, "files": files}, out)
    os.replace(tmp, path)
    log.info("start pages: recorded %.0f MB in %d files to %s", total / 1e6, len(files), path)
    return total


def record_in_background(path: str) -> None:
    """record(path) on a daemon thread, once: a worker calls it when its engine is ready."""
    if os.path.exists(path):
        return

    def run() -> None:
        try:
            record(path)
        except OSError as e:
            log.info("start pages: not recorded (%s)", e)

    threading.Thread(target=run, daemon=True, name="start-pages").start()


def load(path: str) -> list[tuple[str, int, int]]:
    """(file, offset, length) reads of a record; [] when there is none or it is unreadable."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return []
    if data.get("format") != FORMAT:
        return []
    out = []
    for name, ranges in data.get("files", []):
        for off, n in ranges:
            out += [
                (name, o, min(READ_BYTES, off + n - o)) for o in range(off, off + n, READ_BYTES)
            ]
    return out


def _in_threads(fn, items: list, threads: int) -> list:
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="start-pages") as pool:
        return list(pool.map(fn, items))


def _walk_metadata(names: list[str], threads: int) -> None:
    """List every directory on the way to the files and stat each file: with caches dropped, the
    imports' directory listings and inode lookups are small reads of their own, which would
    otherwise wait behind the weight stream."""
    dirs: dict[str, None] = {}
    for name in names:
        d = os.path.dirname(name)
        while d and d not in dirs:
            dirs[d] = None
            d = os.path.dirname(d) if d != "/" else ""

    def touch(item: tuple) -> None:
        fn, arg = item
        try:
            fn(arg)
        except OSError:
            pass

    _in_threads(touch, [(os.listdir, d) for d in dirs] + [(os.stat, n) for n in names], threads)


def read(path: str, threads: int = 8) -> int:
    """Read a record's directories, inodes and ranges into the kernel's caches (several reads in
    flight, in record order); returns the bytes read. A file gone or changed since is skipped: this
    is only a head start."""
    work = load(path)
    _walk_metadata(list(dict.fromkeys(name for name, _, _ in work)), threads * 2)
    local = threading.local()

    def read_one(item: tuple) -> int:
        name, off, n = item
        if not hasattr(local, "buf"):
            local.buf = memoryview(bytearray(READ_BYTES))
        try:
            fd = os.open(name, os.O_RDONLY)
        except OSError:
            return 0
        try:
            return os.preadv(fd, [local.buf[:n]], off)
        except OSError:
            return 0
        finally:
            os.close(fd)

    return sum(_in_threads(read_one, work, threads))
