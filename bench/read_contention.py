"""What the weight stream's reads do to the start's other reads on the same disk: the latency of
small cold reads (a module, a manifest, a directory) while readers like the device stream's
(cache/stream_process.py: T threads, each reading C-byte chunks with O_DIRECT, round-robin over the
file) run, and the stream's own throughput, for several (T, C).

    python -m bench.read_contention [--file BIG] [--size-gb 8] [--configs 16x16,4x16,4x4]

BIG is read with O_DIRECT, so the page cache does not hide the disk (default: a file of --size-gb
written once under --dir). Each probe is a 64 KiB file whose pages are dropped first
(posix_fadvise DONTNEED), then read whole: the kind of read an import or a manifest makes.
Prints one line per configuration (T x C MiB; "none" is the probes alone) and writes
OUT/read_contention.json.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import threading
import time

PROBE_BYTES = 64 << 10


def _big_file(path: str, size_gb: float) -> str:
    size = int(size_gb * (1 << 30))
    if os.path.exists(path) and os.path.getsize(path) >= size:
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    block = os.urandom(16 << 20)
    with open(path + ".tmp", "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    return path


def _probes(directory: str, count: int) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    paths = []
    for i in range(count):
        path = os.path.join(directory, f"probe-{i:03d}.bin")
        if not os.path.exists(path):
            with open(path, "wb") as f:
                f.write(os.urandom(PROBE_BYTES))
                f.flush()
                os.fsync(f.fileno())
        paths.append(path)
    return paths


def _cold_read_s(path: str) -> float:
    """Seconds to open and read `path` whole, its pages dropped first."""
    fd = os.open(path, os.O_RDONLY)
    try:  # the probes are written once and synced, so their pages are clean and can be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(PROBE_BYTES):
            pass
    return time.perf_counter() - t0


class Stream:
    """T threads reading `path` with O_DIRECT in C-byte chunks, chunk i to thread i % T, round and
    round until stopped; counts the bytes read."""

    def __init__(self, path: str, threads: int, chunk: int):
        self.path, self.threads, self.chunk = path, threads, chunk
        self.size = os.path.getsize(path) // chunk * chunk
        self.bytes = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.workers = [
            threading.Thread(target=self._read, args=(t,), daemon=True) for t in range(threads)
        ]

    def _read(self, t: int) -> None:
        buf = mmap.mmap(-1, self.chunk)  # page-aligned, as O_DIRECT wants
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            i = t
            while not self.stop.is_set():
                off = (i * self.chunk) % self.size
                n = os.preadv(fd, [buf], off)
                with self.lock:
                    self.bytes += n
                i += self.threads
        finally:
            os.close(fd)
            buf.close()

    def __enter__(self) -> Stream:
        for w in self.workers:
            w.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for w in self.workers:
            w.join()


def measure(big: str, probes: list[str], threads: int, chunk_mib: int, settle_s: float) -> dict:
    if threads == 0:
        lat = [_cold_read_s(p) for p in probes]
        return {"config": "none", "probe_ms": _ms(lat)}
    with Stream(big, threads, chunk_mib << 20) as stream:
        time.sleep(settle_s)
        b0, t0 = stream.bytes, time.perf_counter()
        lat = [_cold_read_s(p) for p in probes]
        gbps = (stream.bytes - b0) / (time.perf_counter() - t0) / 1e9
    return {"config": f"{threads}x{chunk_mib}", "stream_GBps": gbps, "probe_ms": _ms(lat)}


def _ms(seconds: list[float]) -> dict:
    ms = sorted(1e3 * s for s in seconds)
    return {
        "median": statistics.median(ms),
        "p90": ms[int(0.9 * (len(ms) - 1))],
        "max": ms[-1],
        "total": sum(ms),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dir", default="/tmp/coldbrew-read-contention")
    ap.add_argument("--file", help="a large file to stream (default: one written under --dir)")
    ap.add_argument("--size-gb", type=float, default=8.0)
    ap.add_argument("--configs", default="none,16x16,8x16,4x16,16x4,4x4")
    ap.add_argument("--probes", type=int, default=40)
    ap.add_argument("--settle-s", type=float, default=1.0)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = ap.parse_args()
    big = args.file or _big_file(os.path.join(args.dir, "big.bin"), args.size_gb)
    probes = _probes(os.path.join(args.dir, "probes"), args.probes)
    rows = []
    for config in args.configs.split(","):
        threads, chunk = (0, 0) if config == "none" else map(int, config.split("x"))
        row = measure(big, probes, threads, chunk, args.settle_s)
        rows.append(row)
        p = row["probe_ms"]
        stream = f", stream {row['stream_GBps']:.2f} GB/s" if "stream_GBps" in row else ""
        print(
            f"{row['config']:>6}: {len(probes)} cold 64 KiB reads, median {p['median']:.1f} ms, "
            f"p90 {p['p90']:.1f} ms, all {p['total']:.0f} ms{stream}",
            flush=True,
        )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "read_contention.json")
    with open(path, "w") as f:
        json.dump({"file": big, "rows": rows}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
