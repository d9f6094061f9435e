"""Page-cache residency (mincore) and prefetch: read weight files into the page cache in background threads.

Stdlib only, so a worker calls prefetch() first thing and `import torch` overlaps the disk reads.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading
import time
from typing import Any

from cache.pack import find_packs

log = logging.getLogger(__name__)

# Caches dropped on the H100, a 16 GB pack: `import torch` beside the prefetch is starved of the disk whatever the
# prefetch's depth (alone 4.0-5.9 s; beside 1 x 4 MiB reads 10.8 s, 1 x 16 MiB 12.5 s, 8 x 64 MiB 13.3-15.2 s, one
# 1 MiB read until boost() 9.0 s), while the prefetch reaches the disk's rate only with many reads in flight
# (0.9 GB/s at 1 x 16 MiB, 1.4-1.6 GB/s at 8 x 64 MiB). Every setting measured lands at 18-19 s to the first token
# (README, "Cold start"); the deep one finishes the weights first.
PREFETCH_THREADS = 8
PREFETCH_CHUNK_BYTES = 64 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


# ---- page-cache residency (mincore) ------------------------------------------------------------------------
def resident_fraction(path: str, offset: int = 0, length: int | None = None, samples: int | None = None
                      ) -> float | None:
    """Fraction of the byte range's pages now in the page cache (Linux mincore), or None where it can't tell.

    samples: look at that many evenly spaced pages only (a whole 16 GB file takes ~0.2 s to scan)."""
    vec = page_residency(path, offset, length, samples)
    if vec is None:
        return None
    return (1.0 - vec.count(0) / len(vec)) if len(vec) else 1.0


def page_residency(path: str, offset: int = 0, length: int | None = None, samples: int | None = None
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
                return bytes(vec) if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(span), vec) == 0 else None
            one = (ctypes.c_ubyte * 1)()
            out = bytearray()
            for i in range(samples):
                page = i * (pages - 1) // max(1, samples - 1)
                if libc.mincore(ctypes.c_void_p(addr + page * _PAGE), ctypes.c_size_t(_PAGE), one) != 0:
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
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            lib.mmap.restype = ctypes.c_void_p
            lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_long]
            lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            _LIBC = lib
        except (OSError, AttributeError):
            _LIBC = None
    return _LIBC


# ---- prefetch: pull a file into the page cache in the background (stdlib only) ---------------------------
class Prefetch:
    """A background thread (plus helpers) reading files into the page cache, skipping pages already cached.

    The constructor only starts it. `wait()` blocks until done. It never raises: a prefetch is only a hint."""

    def __init__(self, paths: list[str], threads: int, chunk_bytes: int, lead=None, gentle_bytes: int = 0) -> None:
        """lead: a callable listing files to read before `paths` (run on the prefetch thread, not the caller's).
        gentle_bytes: until boost(), one thread reads in pieces of this size (a short disk queue, so the imports'
        own small reads are not starved); then all threads read whole chunks. 0: full depth from the start."""
        self.paths = paths
        self._gentle = gentle_bytes
        self._boosted = threading.Event()
        if not gentle_bytes:
            self._boosted.set()
        self._planned = False
        self._helpers: list[threading.Thread] | None = None  # None: not started yet
        self.bytes_read = 0
        self.started = time.perf_counter()
        self.finished: float | None = None
        self._cond = threading.Condition()
        self._work: list[tuple[str, int, int]] = []
        self._done = bytearray()  # one flag per work item: read (or failed)
        self._spans: dict[str, list[int]] = {}  # realpath -> [first item not yet read, end of its items]
        self._next = 0
        for p in paths:
            _ACTIVE[os.path.realpath(p)] = self
        self._threads = threads
        self._chunk_bytes = chunk_bytes
        self._main = threading.Thread(target=self._plan_and_run, args=(lead,), daemon=True, name="prefetch")
        self._main.start()

    @property
    def boosted(self) -> bool:
        """True once reading at full depth (always, without gentle_bytes)."""
        return self._boosted.is_set()

    def boost(self) -> None:
        """Read at full depth from now on (the caller's imports are done); a no-op when already so."""
        self._boosted.set()
        self._start_helpers()

    def _start_helpers(self) -> None:
        with self._cond:
            if self._helpers is not None or not self._planned or not self._boosted.is_set():
                return
            self._helpers = [threading.Thread(target=self._run, daemon=True, name=f"prefetch-{i}")
                             for i in range(1, max(1, min(self._threads, len(self._work))))]
            for t in self._helpers:
                t.start()

    def _plan_and_run(self, lead) -> None:
        chunk_bytes = self._chunk_bytes
        try:
            work: list[tuple[str, int, int]] = []
            spans: dict[str, list[int]] = {}
            lead_paths = [p for p in (lead() if lead else []) if p not in self.paths]
            for p in lead_paths + self.paths:
                size = os.path.getsize(p)
                vec = page_residency(p, 0, None)
                first = len(work)
                work += [(p, off, min(chunk_bytes, size - off)) for off in range(0, size, chunk_bytes)
                         if vec is None or not _all_resident(vec, off, min(chunk_bytes, size - off))]
                spans[os.path.realpath(p)] = [first, len(work)]
            with self._cond:
                self._work, self._done, self._spans = work, bytearray(len(work)), spans
                self._planned = True
                self._cond.notify_all()
            self._start_helpers()
            self._run()
            with self._cond:  # no helper starts after this; wait for those that did
                helpers = self._helpers or []
                self._helpers = helpers
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
                while got < n:  # one read per item at full depth; pieces of gentle_bytes until boosted
                    step = n - got if self._boosted.is_set() else min(self._gentle, n - got)
                    step = os.preadv(fd, [buf[got: got + step]], off + got)
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
        """Block until this prefetch has read every byte it planned below `end` in `path` (or has stopped).

        A loader reading behind it then finds its chunks in the page cache and never queues its own disk reads
        beside the prefetch's (which would starve the imports that share the disk). False on timeout."""
        real = os.path.realpath(path)
        with self._cond:
            return self._cond.wait_for(lambda: self.finished is not None or self._covered(real, end), timeout)

    def _covered(self, real: str, end: int) -> bool:
        span = self._spans.get(real)
        if span is None:  # not planned yet (or not a file of this prefetch: nothing to wait for once planned)
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


def import_files() -> list[str]:
    """The shared libraries and compiled modules `import torch` (and triton, the CUDA wheels) read, found without
    importing them: reading these first, in big sequential reads, spares the import random reads on a busy disk."""
    import importlib.util

    roots = []
    for name in ("torch", "triton", "nvidia"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        roots += list(spec.submodule_search_locations or []) if spec else []
    tag = f".{sys.implementation.cache_tag}."
    out = []
    for root in roots:
        for here, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d not in ("include", "test", "tests", "testing", "share")]
            out += [os.path.join(here, n) for n in names if ".so" in n or (n.endswith(".pyc") and tag in n)]
    return sorted(out, key=lambda p: (".so" in os.path.basename(p), p))  # the many small .pyc first


def prefetch(path: str, threads: int = PREFETCH_THREADS, chunk_bytes: int = PREFETCH_CHUNK_BYTES,
             imports_first: bool = False, gentle_bytes: int = 0) -> Prefetch:
    """Start reading weights into the page cache now, in daemon threads, and return at once.

    `path` is a pack file, or a model directory: its newest pack under `packs/` if there is one, else its
    *.safetensors files. Imports only the stdlib, so a worker calls it first thing and `import torch` overlaps
    the disk reads; pages already cached are skipped. A later load_pack of the same file reads through the
    page cache (not O_DIRECT) while this runs. imports_first: read import_files() before the weights.
    gentle_bytes: read one piece of that size at a time until boost() (a loader following this prefetch boosts it).
    """
    if os.path.isdir(path):
        packs = find_packs(os.path.join(path, "packs"))
        paths = packs[:1] or sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    else:
        paths = [path]
    return Prefetch(paths, threads, chunk_bytes, lead=import_files if imports_first else None,
                    gentle_bytes=gentle_bytes)
