"""Page-cache residency (mincore) and prefetch: read weight files into the page cache in background
threads.

Stdlib only, so a worker calls prefetch() first thing and `import torch` overlaps the disk reads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
from typing import Any

from cache.pack import find_packs

log = logging.getLogger(__name__)

# Many reads in flight: a disk reaches its rate only so.
PREFETCH_THREADS = 8
PREFETCH_CHUNK_BYTES = 64 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


# ---- page-cache residency (mincore) --------------------------------------------------------------
def resident_fraction(
    path: str, offset: int = 0, length: int | None = None, samples: int | None = None
) -> float | None:
    """Fraction of the byte range's pages now in the page cache (Linux mincore), or None where it
    can't tell.

    samples: look at that many evenly spaced pages only (a scan of every page of a weight file
    costs a visible part of a start)."""
    vec = page_residency(path, offset, length, samples)
    if vec is None:
        return None
    return (1.0 - vec.count(0) / len(vec)) if len(vec) else 1.0


def page_residency(
    path: str, offset: int = 0, length: int | None = None, samples: int | None = None
) -> bytes | None:
    """One byte per page (bit 0: cached) of the range, or of `samples` evenly spaced pages in it."""
    libc = _libc()
    if libc is None:
        return None
    size = os.path.getsize(path)
    start = (offset // _PAGE) * _PAGE
    end = size if length is None else min(size, offset + length)
    span = end - start
    if span <= 0:
        return b""
    pages = -(-span // _PAGE)
    fd = os.open(path, os.O_RDONLY)
    try:
        prot_read, map_shared = 1, 1
        addr = libc.mmap(None, span, prot_read, map_shared, fd, start)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            if samples is None or samples >= pages:
                vec = (ctypes.c_ubyte * pages)()
                return (
                    bytes(vec)
                    if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(span), vec) == 0
                    else None
                )
            one = (ctypes.c_ubyte * 1)()
            out = bytearray()
            for i in range(samples):
                page = i * (pages - 1) // max(1, samples - 1)
                if (
                    libc.mincore(ctypes.c_void_p(addr + page * _PAGE), ctypes.c_size_t(_PAGE), one)
                    != 0
                ):
                    return None
                out.append(one[0])
            return bytes(out)
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(span))
    finally:
        os.close(fd)


_LIBC: Any = False


def _libc():
    global _LIBC
    if _LIBC is False:
        try:  # the interpreter's own symbols hold libc's (find_library would run `ldconfig -p`)
            lib = ctypes.CDLL(None, use_errno=True)
            if not hasattr(lib, "mincore"):
                lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            lib.mmap.restype = ctypes.c_void_p
            lib.mmap.argtypes = [
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_long,
            ]
            lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            _LIBC = lib
        except (OSError, AttributeError):
            _LIBC = None
    return _LIBC


# ---- prefetch: pull a file into the page cache in the background (stdlib only) -------------------
class Prefetch:
    """A background thread (plus helpers) reading files into the page cache, skipping pages already
    cached.

    The constructor only starts it. `wait()` blocks until done. It never raises: a prefetch is only
    a hint."""

    def __init__(self, paths: list[str], threads: int, chunk_bytes: int) -> None:
        self.paths = paths
        self.bytes_read = 0
        self.started = time.perf_counter()
        self.finished: float | None = None
        self._cond = threading.Condition()
        self._work: list[tuple[str, int, int]] = []
        self._done = bytearray()  # one flag per work item: read (or failed)
        self._spans: dict[
            str, list[int]
        ] = {}  # realpath -> [first item not yet read, end of its items]
        self._next = 0
        for p in paths:
            _ACTIVE[os.path.realpath(p)] = self
        self._threads = threads
        self._chunk_bytes = chunk_bytes
        self._main = threading.Thread(target=self._plan_and_run, daemon=True, name="prefetch")
        self._main.start()

    def _plan_and_run(self) -> None:
        chunk_bytes = self._chunk_bytes
        try:
            work: list[tuple[str, int, int]] = []
            spans: dict[str, list[int]] = {}
            for p in self.paths:
                size = os.path.getsize(p)
                vec = page_residency(p, 0, None)
                first = len(work)
                work += [
                    (p, off, min(chunk_bytes, size - off))
                    for off in range(0, size, chunk_bytes)
                    if vec is None or not _all_resident(vec, off, min(chunk_bytes, size - off))
                ]
                spans[os.path.realpath(p)] = [first, len(work)]
            with self._cond:
                self._work, self._done, self._spans = work, bytearray(len(work)), spans
                self._cond.notify_all()
            helpers = [
                threading.Thread(target=self._run, daemon=True, name=f"prefetch-{i}")
                for i in range(1, max(1, min(self._threads, len(work))))
            ]
            for t in helpers:
                t.start()
            self._run()
            for t in helpers:
                t.join()
        except OSError as e:
            log.debug("prefetch stopped: %s", e)
        finally:
            with self._cond:
                self.finished = time.perf_counter()
                self._cond.notify_all()
            for p in self.paths:
                _ACTIVE.pop(os.path.realpath(p), None)

    def _run(self) -> None:
        buf = memoryview(bytearray(self._chunk_bytes))
        fds: dict[str, int] = {}
        i = -1
        try:
            while True:
                with self._cond:
                    if self._next >= len(self._work):
                        return
                    i = self._next
                    path, off, n = self._work[i]
                    self._next += 1
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = os.open(path, os.O_RDONLY)
                got = 0
                while got < n:
                    step = os.preadv(fd, [buf[got:n]], off + got)
                    if step == 0:
                        break
                    got += step
                with self._cond:
                    self.bytes_read += got
                    self._done[i] = 1
                    self._cond.notify_all()
        except OSError as e:  # the real load reads (and reports) for itself
            log.debug("prefetch stopped: %s", e)
        finally:
            for fd in fds.values():
                os.close(fd)

    def wait_covered(self, path: str, end: int, timeout: float | None = None) -> bool:
        """Block until this prefetch has read every byte it planned below `end` in `path` (or has
        stopped).

        A loader reading behind it then finds its chunks in the page cache and never queues its own
        disk reads beside the prefetch's (which would starve the imports that share the disk). False
        on timeout."""
        real = os.path.realpath(path)
        with self._cond:
            return self._cond.wait_for(
                lambda: self.finished is not None or self._covered(real, end), timeout
            )

    def _covered(self, real: str, end: int) -> bool:
        span = self._spans.get(real)
        # not planned yet (or not a file of this prefetch: nothing to wait for once planned)
        if span is None:
            return bool(self._spans) or bool(self._work)
        while span[0] < span[1] and self._done[span[0]]:
            span[0] += 1
        return span[0] >= span[1] or self._work[span[0]][1] >= end

    def done(self) -> bool:
        return not self._main.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        self._main.join(timeout)
        return self.done()


_ACTIVE: dict[str, Prefetch] = {}


def _all_resident(vec: bytes, offset: int, length: int) -> bool:
    first, last = offset // _PAGE, -(-(offset + length) // _PAGE)
    return 0 not in vec[first:last]


def prefetch(
    path: str,
    threads: int = PREFETCH_THREADS,
    chunk_bytes: int = PREFETCH_CHUNK_BYTES,
    want: tuple[str, str | None] | None = None,
) -> Prefetch:
    """Start reading weights into the page cache now, in daemon threads, and return at once.

    `path` is a pack file, or a model directory: its newest pack under `packs/` (the newest named
    for `want`, the engine's dtype and quantization settings, where there is one: cache.pack's
    find_packs), else its *.safetensors files. Imports only the stdlib, so a worker calls it first
    thing and `import torch` overlaps the disk reads; pages already cached are skipped. A later
    load_pack of the same file reads through the page cache (not O_DIRECT) while this runs.
    """
    if os.path.isdir(path):
        packs = find_packs(os.path.join(path, "packs"), want=want)
        paths = packs[:1] or sorted(
            os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors")
        )
    else:
        paths = [path]
    return Prefetch(paths, threads, chunk_bytes)
