"""The streaming loader: a pack -> one device buffer holding every tensor, each tensor a view into
it.

Reader threads (O_DIRECT when the file is not in the page cache) fill pinned buffers; copies run on
their own CUDA stream; each group (layer) gets a ready event. Stdlib at import (torch only inside),
so prefetch runs first; preload() starts the stream as soon as CUDA is up, and the engine's
load_pack of the same file takes it over.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from dataclasses import dataclass

from cache.pack import (
    ALIGNMENT,
    DTYPE_NAMES,
    Pack,
    PackError,
    PackWriter,
    find_packs,
    pack_name,
    read_pack,
    shard_name,
)
from cache.prefetch import _ACTIVE, Prefetch, prefetch, resident_fraction

# The engine imports cache.loader only: the pack's writer, reader and error, and prefetch, come from
# here too.
__all__ = [
    "LoadStats",
    "Pack",
    "PackError",
    "PackWriter",
    "Prefetch",
    "StreamingLoad",
    "discard_preloads",
    "group_spans",
    "load_pack",
    "prefetch",
    "preload",
    "read_pack",
    "read_span",
    "register_pending",
    "forget_pending",
    "resident_fraction",
    "shard_name",
    "pack_name",
    "DTYPE_NAMES",
    "tensor_views",
]

log = logging.getLogger(__name__)

# Loader: pinning host memory costs seconds of thread time per GiB in a fresh process, so the ring
# is kept small: 16 threads x 2 x 16 MiB = 512 MiB, pinned lazily by the threads themselves. Each
# chunk takes the GIL a few times, and a main thread importing or building the engine meanwhile
# holds it: fewer, bigger chunks stream faster beside it (docs/performance.md, "The start sequence
# inside one process", from bench/results/2026-11-22-h100-cold-start-variants.json).
DEFAULT_CHUNK_BYTES = 16 << 20


# ---- the streaming load --------------------------------------------------------------------------
def tensor_views(pack: Pack, buffer) -> dict:
    """name -> the tensor as a view into `buffer`, a uint8 tensor holding the pack's data span."""
    import torch

    out = {}
    for e in pack.entries:
        lo = e.offset - pack.data_offset
        out[e.name] = buffer[lo : lo + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)
    return out


def group_spans(pack: Pack) -> dict[int, tuple[int, int]]:
    """group -> (first byte, end) in the file of the span its tensors cover."""
    spans: dict[int, tuple[int, int]] = {}
    for e in pack.entries:
        lo, hi = spans.get(e.group, (e.offset, e.offset + e.nbytes))
        spans[e.group] = (min(lo, e.offset), max(hi, e.offset + e.nbytes))
    return spans


def read_span(
    path: str, fds: dict[bool, int], view: memoryview, offset: int, n: int, direct: bool
) -> bool:
    """Fill view[:n] from `path` at offset, opening it once per mode (fds: O_DIRECT or not -> fd,
    the caller's to close). O_DIRECT reads whole aligned pages, as far as the view has room; where
    it is refused (EINVAL, EOPNOTSUPP: tmpfs, odd alignment) the reads go on buffered. Returns
    whether O_DIRECT is still in use."""
    done = 0
    while done < n:
        want = min(len(view), -(-n // ALIGNMENT) * ALIGNMENT) if direct else n
        try:
            fd = fds.get(direct)
            if fd is None:
                fd = fds[direct] = os.open(
                    path, os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
                )
            got = os.preadv(fd, [view[done:want]], offset + done)
        except OSError as e:
            if direct and e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                direct = False
                continue
            raise
        if got == 0:
            raise OSError(errno.EIO, f"pack {path}: unexpected end of file at {offset + done}")
        done += got
    return direct


def direct_reads_work(path: str, offset: int) -> bool:
    """Whether `path` can be read with O_DIRECT (one aligned page at `offset`, itself aligned):
    tmpfs and some network and FUSE file systems refuse it."""
    import mmap

    if not hasattr(os, "O_DIRECT"):
        return False
    buf = mmap.mmap(-1, ALIGNMENT)  # page-aligned, as O_DIRECT wants
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [buf], offset - offset % ALIGNMENT)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        buf.close()


@dataclass
class LoadStats:
    nbytes: int
    seconds: float  # first read -> last byte on the device
    alloc_seconds: float  # the device buffer and the views
    # pinned ring allocation summed over threads (they overlap each other and the reads)
    pin_seconds: float
    mode: str  # "direct" (O_DIRECT) or "buffered"
    threads: int
    chunk_bytes: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class StreamingLoad:
    """One pack streaming into one device buffer. `tensors` are views, valid once their group is
    ready."""

    def __init__(
        self,
        pack: Pack,
        device,
        threads: int,
        chunk_bytes: int,
        direct: str | bool,
        ring_per_thread: int = 2,
    ) -> None:
        import torch

        if chunk_bytes <= 0 or chunk_bytes % ALIGNMENT:
            raise ValueError(
                f"chunk_bytes: must be a positive multiple of {ALIGNMENT}, got {chunk_bytes}"
            )
        if threads < 1:
            raise ValueError(f"threads: must be at least 1, got {threads}")
        t0 = time.perf_counter()
        self.pack = pack
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        nbytes = pack.data_nbytes
        if self.cuda:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        else:  # over-allocate so the buffer starts page-aligned, as O_DIRECT wants
            raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
            skip = (-raw.data_ptr()) % ALIGNMENT
            self.buffer = raw[skip : skip + nbytes]
        self.tensors = tensor_views(pack, self.buffer)
        self.mode = self._choose_mode(direct)
        # A prefetch still reading this file: the readers follow it instead of queueing disk reads
        # of their own.
        self._prefetch = (
            _ACTIVE.get(os.path.realpath(pack.path)) if self.mode == "buffered" else None
        )
        self.chunk_bytes = chunk_bytes
        self._chunks = [
            (off, min(chunk_bytes, pack.data_end - off))
            for off in range(pack.data_offset, pack.data_end, chunk_bytes)
        ]
        self._group_span = group_spans(pack)
        self._pending = {
            g: sum(1 for off, n in self._chunks if off < hi and off + n > lo) or 0
            for g, (lo, hi) in self._group_span.items()
        }
        self._groups_of_chunk = [
            [g for g, (lo, hi) in self._group_span.items() if off < hi and off + n > lo]
            for off, n in self._chunks
        ]
        self._ready = {g: threading.Event() for g in self._group_span}
        self._cuda_events = {g: torch.cuda.Event() for g in self._group_span} if self.cuda else {}
        self._lock = threading.Lock()
        self._next = 0
        self._error: BaseException | None = None
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        for g, left in self._pending.items():
            if left == 0:  # a group of empty tensors
                self._mark_ready(g)
        n_threads = max(1, min(threads, len(self._chunks)))
        self._alloc_seconds = time.perf_counter() - t0
        self._started = time.perf_counter()
        self._finished: float | None = None
        self._pin_seconds = 0.0
        self._threads = [
            threading.Thread(
                target=self._worker, args=(ring_per_thread,), daemon=True, name=f"pack-loader-{i}"
            )
            for i in range(n_threads)
        ]
        self._stats_threads = n_threads
        for t in self._threads:
            t.start()

    def _choose_mode(self, direct: str | bool) -> str:
        if direct is True or direct == "direct":
            return "direct"
        if direct is False or direct == "buffered":
            return "buffered"
        # a prefetch is pulling it into the page cache
        if os.path.realpath(self.pack.path) in _ACTIVE:
            return "buffered"
        resident = resident_fraction(
            self.pack.path, self.pack.data_offset, self.pack.data_nbytes, samples=256
        )
        return "buffered" if resident is None or resident >= 0.5 else "direct"

    # -- workers --
    def _read(self, fds: dict[bool, int], dest: memoryview, offset: int) -> None:
        """Fill dest from the file at offset; a refused O_DIRECT switches this load to buffered
        reads."""
        if not read_span(self.pack.path, fds, dest, offset, len(dest), self.mode == "direct"):
            self.mode = "buffered"

    def _worker(self, ring: int) -> None:
        import torch

        fds: dict[bool, int] = {}
        slots: list[
            tuple
        ] = []  # (pinned buffer, its numpy memoryview, the event of the last copy out of it)
        try:
            if self.cuda:
                torch.cuda.set_device(self.device)
                # this thread's current stream: every copy goes there
                torch.cuda.set_stream(self.copy_stream)
            turn = 0
            while self._error is None:
                with self._lock:
                    i = self._next
                    self._next += 1
                if i >= len(self._chunks):
                    break
                off, n = self._chunks[i]
                lo = off - self.pack.data_offset
                if self._prefetch is not None:
                    self._prefetch.wait_covered(self.pack.path, off + n)
                if not self.cuda:
                    self._read(fds, memoryview(self.buffer[lo : lo + n].numpy()), off)
                    self._issued(i)
                    continue
                # pinned lazily: the first read starts after one buffer, not the whole ring
                if len(slots) < ring:
                    t0 = time.perf_counter()
                    host = torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True)
                    slots.append((host, memoryview(host.numpy()), torch.cuda.Event()))
                    with self._lock:
                        self._pin_seconds += time.perf_counter() - t0
                host, view, copied = slots[turn % ring]
                turn += 1
                # The previous copy out of this pinned buffer may not have finished yet; ask first,
                # as a wait gives up the GIL, and getting it back costs.
                if not copied.query():
                    copied.synchronize()
                self._read(fds, view[:n], off)
                self.buffer[lo : lo + n].copy_(host[:n], non_blocking=True)
                copied.record(self.copy_stream)
                self._issued(i)
            for _, _, copied in slots:
                copied.synchronize()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            with self._lock:
                if self._error is None:
                    self._error = e
            for ev in self._ready.values():
                ev.set()
        finally:
            for fd in fds.values():
                os.close(fd)

    def _issued(self, chunk: int) -> None:
        """Chunk read (CPU) or its copy enqueued (CUDA): groups whose every chunk is in are
        ready."""
        with self._lock:  # the record below must follow every copy of the group on the copy stream
            for g in self._groups_of_chunk[chunk]:
                self._pending[g] -= 1
                if self._pending[g] == 0:
                    self._mark_ready(g)

    def _mark_ready(self, g: int) -> None:
        if self.cuda:
            self._cuda_events[g].record(self.copy_stream)
        self._ready[g].set()

    # -- the consumer's side --
    def group_ready(self, group: int) -> bool:
        """True once the group's bytes are on the device (CUDA: once its event has completed)."""
        if not self._ready[group].is_set() or self._error is not None:
            return False
        return self._cuda_events[group].query() if self.cuda else True

    def wait_group(self, group: int, stream=None) -> None:
        """Block until the group's copies are enqueued; on CUDA, make `stream` (default: current)
        wait for them."""
        self._ready[group].wait()
        self._raise()
        if self.cuda:
            import torch

            (stream or torch.cuda.current_stream(self.device)).wait_event(self._cuda_events[group])

    def wait(self) -> LoadStats:
        """Block until every byte is on the device; re-raises a reader's error."""
        for t in self._threads:
            t.join()
        self._raise()
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        if self._finished is None:
            self._finished = time.perf_counter()
        return self.stats

    def cancel(self) -> None:
        """Stop the readers, wait for them and free the device buffer (a preload nobody claimed)."""
        with self._lock:
            if self._error is None:
                self._error = _Cancelled("the load was cancelled")
        for t in self._threads:
            t.join()
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        self.tensors = {}
        self.buffer = None

    def _raise(self) -> None:
        """A read error means the pack is bad (PackError: rebuild it); anything else is the
        machine's (RuntimeError)."""
        if self._error is None:
            return
        kind = PackError if isinstance(self._error, OSError) else RuntimeError
        raise kind(f"pack {self.pack.path}: loading failed: {self._error}") from self._error

    @property
    def stats(self) -> LoadStats:
        end = self._finished or time.perf_counter()
        return LoadStats(
            self.pack.data_nbytes,
            end - self._started,
            self._alloc_seconds,
            self._pin_seconds,
            self.mode,
            self._stats_threads,
            self.chunk_bytes,
        )


class _Cancelled(Exception):
    pass


def load_pack(
    pack: Pack | str,
    device="cpu",
    *,
    threads: int | None = None,
    chunk_bytes: int | None = None,
    direct: str | bool = "auto",
) -> StreamingLoad:
    """Start streaming a pack into one buffer on `device` and return at once; call wait() or
    wait_group(g).

    direct: "auto" (O_DIRECT unless most of the file is in the page cache or a prefetch is running),
    True, False. A preload() of the same file to the same device is taken over (whatever its
    options) instead of a new load.
    """
    path = pack if isinstance(pack, str) else pack.path
    claimed = _claim_preload(path, device)
    if claimed is not None:
        return claimed
    if isinstance(pack, str):
        pack = read_pack(pack)
    if threads is None:
        threads = min(16, os.cpu_count() or 4)
    if chunk_bytes is None:
        chunk_bytes = DEFAULT_CHUNK_BYTES
    return StreamingLoad(pack, device, threads, chunk_bytes, direct)


# ---- preload: the stream starts before the engine asks for it ------------------------------------
_PRELOADS: dict[tuple[str, str], StreamingLoad] = {}
_PRELOADS_LOCK = threading.Lock()


def preload(path: str, device="cuda", **options) -> StreamingLoad | None:
    """Start streaming a pack to `device` now (right after `import torch`, while the engine still
    imports).

    `path` is a pack, or a model directory (its newest pack under `packs/`); None when there is
    none. The engine's load_pack of the same file and device takes this load over;
    discard_preloads() frees one nobody took.
    """
    if os.path.isdir(path):
        packs = find_packs(os.path.join(path, "packs"))
        if not packs:
            return None
        path = packs[0]
    load = load_pack(read_pack(path), device, **options)
    key = (os.path.realpath(path), str(load.device))
    with _PRELOADS_LOCK:
        old = _PRELOADS.pop(key, None)
        _PRELOADS[key] = load
    if old is not None:
        old.cancel()
    log.debug("weights: preloading %s to %s", path, load.device)
    return load


# A load started before torch could be imported (cache.device_stream): realpath -> an object with
# claim(device) (the load, or None to load in-process) and cancel().
_PENDING: dict[str, object] = {}


def register_pending(path: str, pending) -> None:
    """The next load_pack of `path` to a CUDA device asks pending.claim(device) first;
    discard_preloads cancels it."""
    with _PRELOADS_LOCK:
        old = _PENDING.pop(os.path.realpath(path), None)
        _PENDING[os.path.realpath(path)] = pending
    if old is not None:
        old.cancel()


def forget_pending(path: str, pending) -> None:
    """Unregister `pending` (if it is still the one registered for `path`); the caller stops it."""
    with _PRELOADS_LOCK:
        if _PENDING.get(os.path.realpath(path)) is pending:
            del _PENDING[os.path.realpath(path)]


def _claim_preload(path: str, device):
    if not _PRELOADS and not _PENDING:
        return None
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    with _PRELOADS_LOCK:
        load = _PRELOADS.pop((os.path.realpath(path), str(dev)), None)
        pending = _PENDING.pop(os.path.realpath(path), None)
    if load is not None or pending is None:
        if pending is not None:
            pending.cancel()
        return load
    if dev.type != "cuda":
        pending.cancel()
        return None
    return pending.claim(dev)


def discard_preloads(keep: str | None = None) -> int:
    """Cancel every preload (except one of the file `keep`) and free its device memory; returns how
    many."""
    real = os.path.realpath(keep) if keep else None
    with _PRELOADS_LOCK:
        dropped = [k for k in _PRELOADS if k[0] != real]
        loads = [_PRELOADS.pop(k) for k in dropped]
        pending = [_PENDING.pop(k) for k in [k for k in _PENDING if k != real]]
    for p in pending:
        p.cancel()
        log.info("weights: stopped the device stream of %s (the engine loads another file)", p.path)
    for load in loads:
        load.cancel()
        log.info(
            "weights: dropped the preload of %s (the engine loads another file)", load.pack.path
        )
    if loads and any(load.cuda for load in loads):
        import torch

        torch.cuda.empty_cache()
    return len(loads)
