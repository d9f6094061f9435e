"""The start path's own files: which pages of the libraries and modules a worker's start used,
recorded once, so a cold start reads them in a few large reads before the weights instead of `import
torch` faulting them in one small read at a time behind the weight stream (on the H100's disk a cold
import beside the stream took 13.9 s, alone 4.5).

record(path): the files this process maps (/proc/self/maps: torch's and CUDA's shared libraries)
with the pages it touched (present in its page table), and those it imported (sys.modules) or
opened for reading since watch_opens() (package metadata, version and data files) with their pages
now in the page cache (mincore), merged into ranges. read(path): those ranges into the page cache,
in order. Stdlib only.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import stat
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from cache.prefetch import page_residency

log = logging.getLogger(__name__)

# resident runs closer than this are read as one range (a read is cheaper than a seek)
GAP_BYTES = 1 << 20
READ_BYTES = 8 << 20
FORMAT = 1
WEIGHT_SUFFIXES = (".safetensors", ".cbpack", ".gguf", ".bin", ".pt", ".pth")  # never start pages

_PRESENT = bytes(b >> 7 for b in range(256))  # a pagemap entry's top byte -> 1 if present
_opened: dict[str, None] = {}  # files opened for reading while watching, in order
_others: dict[str, None] = {}  # start files of the start's other processes (add_files)
_watching = False
_hooked = False
_expecting = False  # expect_files() was called
_others_sent = threading.Event()
OTHERS_WAIT_S = 120.0


def watch_opens() -> None:
    """From now until the start is recorded: note each file this process opens for reading (Python's
    `open` audit event, PEP 578: builtins.open, io.open and os.open), beside the modules it imports.
    Once per process; the hook does nothing once the watch ends (audit hooks stay for good)."""
    global _watching, _hooked
    _watching = True
    if _hooked:
        return
    _hooked = True

    def hook(event: str, args: tuple) -> None:
        if not _watching or event != "open" or not isinstance(args[0], str):
            return
        path, mode, flags = args
        reading = (
            flags is not None and flags & os.O_ACCMODE == os.O_RDONLY
            if mode is None
            else not set(str(mode)) & set("wax+")
        )
        if reading and not path.endswith(WEIGHT_SUFFIXES):
            _opened.setdefault(os.path.abspath(path), None)

    sys.addaudithook(hook)


def add_files(paths: list[str]) -> None:
    """Files another process of this start used (the RunPod SDK's own process, handler.sdk_front,
    sends its start_files()): recorded with this one's, so a cold start reads them first too."""
    for path in paths:
        _others.setdefault(path, None)
    _others_sent.set()


def expect_files() -> None:
    """Another process of this start will send its files (add_files): the record waits for them,
    up to OTHERS_WAIT_S after the engine is ready (the SDK's local API sends them only at its first
    job)."""
    global _expecting
    _expecting = True


def stop_watching() -> None:
    global _watching
    _watching = False


def default_path(cache_dir: str, entry: str = "") -> str:
    """One record per interpreter, environment (a different venv maps different files) and entry
    point (the RunPod worker's SDK process imports the SDK, the server Starlette)."""
    key = f"{sys.executable}\0{sys.version}\0{sys.prefix}" + (f"\0{entry}" if entry else "")
    key = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(cache_dir, "start-pages", f"{key}.json")


def file_mappings(maps: str = "/proc/self/maps") -> list[tuple[int, int, int, str]]:
    """(start address, end address, offset in the file, path) of each of this process's mappings
    of a named file, in /proc/self/maps order (`maps`: another such listing); [] where it can't be
    read."""
    out = []
    try:
        with open(maps) as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    out.append((lo, hi, int(parts[2], 16), parts[5].strip()))
    except OSError:
        return []
    return out


def touched_pages(page: int) -> dict[str, bytearray]:
    """For each regular file this process maps: one byte per page of the file, 1 where a mapping
    of it has the page present in this process's page table (/proc/self/pagemap, bit 63: readable
    without privileges). That is what the process touched (and the kernel's fault-around next to
    it), where the page cache's residency (mincore) also counts every page any other process, an
    install or a readahead brought in. {} where pagemap can't be read."""
    out: dict[str, bytearray] = {}
    try:
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return {}
    try:
        for lo, hi, offset, name in file_mappings():
            try:  # a regular file (not a device's mapping, whose range can span gigabytes)
                st = os.stat(name)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            first = offset // page  # the mapping's first page in the file
            count = (hi - lo) // page
            size = st.st_size
            try:
                entries = os.pread(pagemap, 8 * count, 8 * (lo // page))
            except OSError:
                continue
            vec = out.setdefault(name, bytearray(-(-size // page)))
            # bit 63 of each little-endian entry: the top bit of its last byte
            flags = entries[7::8].translate(_PRESENT)[: max(0, len(vec) - first)]
            here = vec[first : first + len(flags)]
            vec[first : first + len(flags)] = (
                bytes(a | b for a, b in zip(here, flags)) if any(here) else flags
            )
    finally:
        os.close(pagemap)
    return out


def start_files() -> list[str]:
    """Mapped regular files first (in load order), then imported modules' files and their bytecode,
    then the files opened for reading while watch_opens() watched, then those of add_files()."""
    out: dict[str, None] = {name: None for _, _, _, name in file_mappings()}
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
    for path in [*_opened, *_others]:
        out.setdefault(path, None)
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
    touched = touched_pages(page)
    files = []
    total = 0
    for f in start_files():
        # a mapped file: the pages this process used; others (read, not mapped): what is cached
        vec = touched.get(f) or page_residency(f)
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
    """record(path) on a daemon thread, once: a worker calls it when its engine is ready (which ends
    the watch of watch_opens)."""
    stop_watching()
    if os.path.exists(path):
        return

    def run() -> None:
        if _expecting and not _others_sent.wait(OTHERS_WAIT_S):
            log.info("start pages: the other process's files did not come; recorded without them")
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
