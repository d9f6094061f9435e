"""The device-stream process: a pack -> one shareable GPU allocation, filled while the worker still
imports torch.

`python -m cache.stream_process PACK ORDINAL SOCKET_FD THREADS CHUNK_BYTES [START_PAGES]` (started
by cache.device_stream). When the pack is not in the page cache, it first reads the start path's
recorded pages (cache.start_pages), so the worker's imports do not queue behind the weights on the
disk. It uses the driver through ctypes (no torch: it is streaming long before the worker has
imported torch) and runs in its own process, so its reader threads never wait for the worker's
interpreter lock, which `import torch` holds for seconds at a time.

On the socket (one JSON object per line): first {"size", "nbytes", "bus_id"} with the allocation's
POSIX fd attached, then {"done_to": OFFSET} each time the prefix of the pack's data on the device
grows (every copy below OFFSET has completed), then {"finished": {stats}} or {"error": "..."}. The
worker sends "mapped" once it has mapped the allocation (this process may then let its own mapping
go and exit) or "cancel"; end of file means the same as cancel.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
import threading
import time

from cache import cuda_driver as cu, start_pages
from cache.loader import direct_reads_work, read_span
from cache.pack import read_pack
from cache.prefetch import resident_fraction

RING_PER_THREAD = 2  # pinned buffers per reader: one is read into while the other's copy runs
# Off the disk (O_DIRECT), one reader of large chunks: the disk sees one sequential read at a time,
# which it serves at least as fast as many readers, and the start's own small reads (imports,
# manifests, the SDK's process) get their turn between two chunks instead of queueing behind a
# dozen (bench/read_contention.py on the H100 machine's disk, docs/performance.md). From the page
# cache the copies are memory-bound and the caller's many readers stay.
DIRECT_READERS = 1
DIRECT_CHUNK_BYTES = 64 << 20


class Streamer:
    def __init__(
        self,
        pack_path: str,
        ordinal: int,
        sock: socket.socket,
        threads: int,
        chunk_bytes: int,
        start_pages: str | None = None,
    ) -> None:
        self.t0 = time.perf_counter()
        self.sock = sock
        self.ordinal = ordinal
        self.pack = read_pack(pack_path)
        resident = resident_fraction(
            pack_path, self.pack.data_offset, self.pack.data_nbytes, samples=256
        )
        self.direct = (
            resident is not None
            and resident < 0.5
            and direct_reads_work(pack_path, self.pack.data_offset)
        )
        if self.direct:
            threads, chunk_bytes = DIRECT_READERS, DIRECT_CHUNK_BYTES
        self.chunk_bytes = chunk_bytes
        self.chunks = [
            (off, min(chunk_bytes, self.pack.data_end - off))
            for off in range(self.pack.data_offset, self.pack.data_end, chunk_bytes)
        ]
        self.threads = max(1, min(threads, len(self.chunks)))
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.next = 0
        self.done = bytearray(len(self.chunks))
        self.prefix = 0  # chunks [0, prefix) are on the device
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.pin_seconds = 0.0
        self.mapped = threading.Event()
        self.start_pages = start_pages

    def send(self, msg: dict, fds: list[int] | None = None) -> None:
        data = (json.dumps(msg) + "\n").encode()
        with self.send_lock:
            if fds:
                socket.send_fds(self.sock, [data], fds)
            else:
                self.sock.sendall(data)

    def listen(self) -> None:
        """The worker's side of the socket: 'mapped', 'cancel', or end of file (the worker is
        gone)."""
        try:
            for line in self.sock.makefile("rb"):
                if line.strip() == b"mapped":
                    self.mapped.set()
                elif line.strip() == b"cancel":
                    break
        except OSError:
            pass
        self.stop.set()  # cancelled, or nobody left to stream for
        self.mapped.set()

    def run(self) -> None:
        threading.Thread(target=self.listen, daemon=True, name="stream-listen").start()
        cu.check_shared_compute_mode(self.ordinal)
        self.ctx = cu.primary_context(self.ordinal)
        t_ctx = time.perf_counter()
        gran = cu.granularity(self.ordinal)
        self.size = -(-self.pack.data_nbytes // gran) * gran
        handle, fd = cu.create_shareable(self.ordinal, self.size)
        self.base = cu.map_handle(handle, self.size, self.ordinal)
        self.send(
            {
                "size": self.size,
                "nbytes": self.pack.data_nbytes,
                "bus_id": cu.pci_bus_id(self.ordinal),
            },
            [fd],
        )
        os.close(fd)
        t_alloc = time.perf_counter()
        pages = start_pages.read(self.start_pages) if self.start_pages and self.direct else 0
        t_pages = time.perf_counter()
        workers = [
            threading.Thread(target=self.worker, daemon=True, name=f"stream-{i}")
            for i in range(self.threads)
        ]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        t_end = time.perf_counter()
        if self.error is not None:
            raise self.error
        if self.stop.is_set() and self.prefix < len(self.chunks):
            return  # cancelled: nobody waits for the rest
        self.send(
            {
                "finished": {
                    "seconds": t_end - t_pages,
                    "since_spawn": t_end - self.t0,
                    "start_pages_bytes": pages,
                    "start_pages_seconds": t_pages - t_alloc,
                    "context_seconds": t_ctx - self.t0,
                    "alloc_seconds": t_alloc - t_ctx,
                    "pin_seconds": self.pin_seconds,
                    "mode": "direct" if self.direct else "buffered",
                    "threads": self.threads,
                    "chunk_bytes": self.chunk_bytes,
                }
            }
        )
        self.mapped.wait()  # our mapping keeps the memory alive until the worker holds its own
        cu.unmap(self.base, self.size)
        cu.release(handle)

    def worker(self) -> None:
        try:
            cu.set_current(self.ctx)
            stream = cu.stream_create()
            slots: list[list] = []  # [host address, writable view, event, chunk in flight or None]
            fds: dict[bool, int] = {}
            turn = 0
            try:
                while not self.stop.is_set() and self.error is None:
                    with self.lock:
                        i, self.next = self.next, self.next + 1
                    if i >= len(self.chunks):
                        break
                    # pinned lazily: reading starts after one buffer, not the ring
                    if len(slots) < RING_PER_THREAD:
                        t = time.perf_counter()
                        host = cu.host_alloc(self.chunk_bytes)
                        view = memoryview(
                            (ctypes.c_char * self.chunk_bytes).from_address(host)
                        ).cast("B")
                        slots.append([host, view, cu.event_create(), None])
                        with self.lock:
                            self.pin_seconds += time.perf_counter() - t
                    slot = slots[turn % len(slots)]
                    turn += 1
                    # the copy out of this buffer must end before it is read into again
                    if slot[3] is not None:
                        cu.event_synchronize(slot[2])
                        self.completed(slot[3])
                    off, n = self.chunks[i]
                    if not read_span(self.pack.path, fds, slot[1], off, n, self.direct):
                        # O_DIRECT refused (tmpfs): every reader goes on buffered
                        self.direct = False
                    cu.copy_to_device_async(
                        self.base + off - self.pack.data_offset, slot[0], n, stream
                    )
                    cu.event_record(slot[2], stream)
                    slot[3] = i
                for slot in slots:
                    if slot[3] is not None:
                        cu.event_synchronize(slot[2])
                        self.completed(slot[3])
            finally:
                for fd in fds.values():
                    os.close(fd)
                for slot in slots:
                    slot[1].release()
                    cu.host_free(slot[0])
        except BaseException as e:  # noqa: BLE001 - reported to the worker by run()
            with self.lock:
                self.error = self.error or e
            self.stop.set()

    def completed(self, chunk: int) -> None:
        with self.lock:
            self.done[chunk] = 1
            start = self.prefix
            while self.prefix < len(self.chunks) and self.done[self.prefix]:
                self.prefix += 1
            if self.prefix == start:
                return
            off, n = self.chunks[self.prefix - 1]
        self.send({"done_to": off + n})


def main(argv: list[str]) -> int:
    path, ordinal, sock_fd, threads, chunk_bytes = (
        argv[0],
        int(argv[1]),
        int(argv[2]),
        int(argv[3]),
        int(argv[4]),
    )
    pages = argv[5] if len(argv) > 5 else None
    sock = socket.socket(fileno=sock_fd)
    try:
        Streamer(path, ordinal, sock, threads, chunk_bytes, pages).run()
        return 0
    except BaseException as e:  # noqa: BLE001 - the worker falls back to loading in-process
        try:
            sock.sendall((json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n").encode())
        except OSError:
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
