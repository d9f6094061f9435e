"""The worker's side of the device stream: weights reach the GPU while the worker is still importing
torch.

`start_weights(model_dir, device)` (stdlib only; the start sequence calls it before `import torch`)
starts the device stream, else the page-cache prefetch. `start(model_dir)` spawns
cache.stream_process, which fills one shareable GPU allocation from the pack. Once torch is up, the
engine's load_pack of that pack takes it over: the allocation is mapped into torch's CUDA context (a
few ms) and becomes one device buffer whose views are the parameters, exactly as the in-process
loader's. Each layer is ready once the process reports its bytes copied.

Anything that goes wrong (no driver, no virtual-memory support, the process dies) logs one line and
the engine loads the pack in-process instead.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

from cache import cuda_driver as cu
from cache.loader import (
    DEFAULT_CHUNK_BYTES,
    LoadStats,
    forget_pending,
    group_spans,
    register_pending,
    tensor_views,
)
from cache.pack import find_packs, read_pack
from cache.prefetch import prefetch

log = logging.getLogger(__name__)

STREAM_THREADS = 16
# the process has the allocation within a second or two; this only bounds a hung driver
HEADER_TIMEOUT_S = 120.0
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class DeviceStreamError(RuntimeError):
    """The stream process failed or ended early; the message is its own."""


class DeviceStream:
    """A running stream process and what it has reported (under `cond`)."""

    def __init__(
        self,
        path: str,
        ordinal: int,
        threads: int,
        chunk_bytes: int,
        start_pages: str | None = None,
    ) -> None:
        self.path = path
        self.ordinal = ordinal
        self.start_pages = start_pages
        self.started = time.perf_counter()
        self.sock, child = socket.socketpair()
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")])),
        )
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cache.stream_process",
                path,
                str(ordinal),
                str(child.fileno()),
                str(threads),
                str(chunk_bytes),
            ]
            + ([start_pages] if start_pages else []),
            pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        child.close()
        self.cond = threading.Condition()
        self.header: dict | None = None
        self.fd: int | None = None
        self.done_to = 0  # every byte of the pack below this offset is on the device
        self.finished: dict | None = None
        self.error: str | None = None
        threading.Thread(target=self._listen, daemon=True, name="device-stream").start()

    def _listen(self) -> None:
        buf = b""
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 1)
            except OSError:
                data, fds = b"", []
            # end of file: the process is exiting
            exit_code = self.proc.wait() if not data else None
            with self.cond:
                if fds and self.fd is None:
                    self.fd = fds[0]
                if not data:
                    if self.finished is None and self.error is None:
                        self.error = f"the stream process ended early (exit code {exit_code})"
                    self.cond.notify_all()
                    return
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    msg = json.loads(line)
                    if "done_to" in msg:
                        self.done_to = max(self.done_to, msg["done_to"])
                    elif "finished" in msg:
                        self.finished = msg["finished"]
                        _log_finished(self.finished)
                    elif "error" in msg:
                        self.error = msg["error"]
                    else:
                        self.header = msg
                self.cond.notify_all()

    def wait_for(self, ready, timeout: float | None = None) -> None:
        """Block until ready() (called under the lock) or an error; raises DeviceStreamError on
        error or timeout."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.error is not None or ready(), timeout):
                raise DeviceStreamError(f"the stream process said nothing for {timeout:.0f} s")
            if self.error is not None and not ready():
                raise DeviceStreamError(self.error)

    def tell(self, word: str) -> None:
        try:
            self.sock.sendall(word.encode() + b"\n")
        except OSError:
            pass

    def cancel(self) -> None:
        """Stop the process (it frees its own GPU memory on exit)."""
        self.tell("cancel")
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with self.cond:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None

    # what loader.load_pack calls on a pending stream
    def claim(self, device):
        """Map the allocation into this process (torch is up) -> a DeviceStreamLoad, or None to load
        in-process."""
        try:
            return DeviceStreamLoad(self, device)
        except (cu.CudaError, DeviceStreamError, OSError) as e:
            log.info(
                "weights: the device stream could not be used (%s); loading in this process", e
            )
            self.cancel()
            return None


def _log_finished(f: dict) -> None:
    log.info(
        "device stream: done %.2f s after its spawn (start pages %.0f MB in %.2f s, then the pack "
        "in %.2f s, %s reads)",
        f.get("since_spawn", 0.0),
        f.get("start_pages_bytes", 0) / 1e6,
        f.get("start_pages_seconds", 0.0),
        f.get("seconds", 0.0),
        f.get("mode", "?"),
    )


class _DeviceMemory:
    """The mapped allocation, seen by torch through the CUDA array interface; unmapped when torch
    lets it go."""

    def __init__(self, ptr: int, size: int) -> None:
        self.ptr, self.size = ptr, size
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }

    def __del__(self) -> None:
        try:
            cu.unmap(self.ptr, self.size)
        except Exception:  # noqa: BLE001 - the driver may already be gone at interpreter exit
            pass


class DeviceStreamLoad:
    """The StreamingLoad interface (tensors, wait_group, group_ready, wait, cancel, stats) over a
    stream process."""

    def __init__(self, stream: DeviceStream, device) -> None:
        import torch

        t0 = time.perf_counter()
        self.stream = stream
        self.pack = read_pack(stream.path)
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda = True
        stream.wait_for(
            lambda: stream.header is not None and stream.fd is not None, HEADER_TIMEOUT_S
        )
        header = stream.header
        if header["nbytes"] != self.pack.data_nbytes:
            raise DeviceStreamError(
                f"the process streams {header['nbytes']} bytes, the pack has "
                f"{self.pack.data_nbytes}"
            )
        torch.cuda.init()
        # torch's context, current on this thread for the calls below
        cu.primary_context(self.device.index)
        bus = cu.pci_bus_id(self.device.index)
        if bus != header["bus_id"]:
            raise DeviceStreamError(
                f"the process streams to GPU {header['bus_id']}, the engine runs on {bus}"
            )
        handle = cu.import_shareable(stream.fd)
        try:
            ptr = cu.map_handle(handle, header["size"], self.device.index)
        finally:
            cu.release(handle)  # the mapping holds the memory from here on
            with stream.cond:
                os.close(stream.fd)
                stream.fd = None
        stream.tell("mapped")
        self.buffer = torch.as_tensor(_DeviceMemory(ptr, header["size"]), device=self.device)[
            : self.pack.data_nbytes
        ]
        self.tensors = tensor_views(self.pack, self.buffer)
        self._spans = group_spans(self.pack)
        self._alloc_seconds = time.perf_counter() - t0

    def _has(self, group: int) -> bool:
        return self.stream.done_to >= self._spans[group][1]

    def group_ready(self, group: int) -> bool:
        with self.stream.cond:
            return self.stream.error is None and self._has(group)

    def wait_group(self, group: int, stream=None) -> None:
        """Block until the group's bytes are on the device (the process has seen its copies
        complete)."""
        self.stream.wait_for(lambda: self._has(group))

    def wait(self) -> LoadStats:
        self.stream.wait_for(lambda: self.stream.finished is not None)
        return self.stats

    def cancel(self) -> None:
        self.stream.cancel()
        self.tensors = {}
        self.buffer = None

    @property
    def stats(self) -> LoadStats:
        f = self.stream.finished or {}
        return LoadStats(
            self.pack.data_nbytes,
            f.get("seconds", time.perf_counter() - self.stream.started),
            self._alloc_seconds,
            f.get("pin_seconds", 0.0),
            f"process-{f.get('mode', 'unknown')}",
            f.get("threads", 0),
            f.get("chunk_bytes", 0),
        )


def start(
    path: str,
    device: str = "cuda",
    threads: int = STREAM_THREADS,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    start_pages: str | None = None,
    shard: tuple[int, int] = (0, 1),
    want: tuple[str, str | None] | None = None,
) -> DeviceStream | None:
    """Start streaming a pack (or a model directory's newest pack) to the GPU in a separate process;
    None when there is no pack or no NVIDIA driver. load_pack of that pack to that device takes the
    stream over.
    start_pages: a cache.start_pages record, read first when the pack is not in the page cache.
    shard: (rank, size) of a pack split over GPUs: the directory's newest pack of that shard.
    want: (dtype setting, quantization) the engine was given: a pack named for them is preferred
    (cache.pack.find_packs).
    A stream begun early (start_early) is adopted when it is this one, and stopped otherwise."""
    early, _EARLY[:] = _EARLY[:], []
    stream = _start(path, device, threads, chunk_bytes, start_pages, shard, want, early)
    _stop([other for other in early if other is not stream])
    return stream


def _start(
    path, device, threads, chunk_bytes, start_pages, shard, want, early
) -> DeviceStream | None:
    """start()'s stream: one of `early` when it is the same pack, GPU and start pages, else new."""
    if not os.path.exists("/dev/nvidiactl"):
        return None
    if os.path.isdir(path):
        packs = find_packs(os.path.join(path, "packs"), *shard, want=want)
        if not packs:
            return None
        path = packs[0]
    ordinal = cuda_ordinal(device)
    if ordinal is None:
        raise ValueError(f"device: {device!r} names no CUDA device")
    if start_pages and not os.path.isfile(start_pages):
        start_pages = None
    real = os.path.realpath(path)
    for stream in early:
        if (stream.path, stream.ordinal, stream.start_pages) == (real, ordinal, start_pages):
            log.info("weights: the stream begun at process start is the one wanted")
            return stream
    stream = DeviceStream(real, ordinal, threads, chunk_bytes, start_pages)
    register_pending(path, stream)
    return stream


# The stream start_early began, until the next start() adopts or stops it.
_EARLY: list[DeviceStream] = []


def start_early(
    model_dir: str,
    device: str,
    start_pages: str | None = None,
    want: tuple[str, str | None] | None = None,
) -> bool:
    """start() ahead of the start sequence (cache.early_stream); True if a stream began. The
    sequence's own start() then adopts it or stops it; cancel_early() stops it when no start()
    follows."""
    stream = start(model_dir, gpu_of(device), start_pages=start_pages, want=want)
    if stream is not None:
        _EARLY.append(stream)
    return stream is not None


def cancel_early() -> None:
    """Stop a stream begun early that no start() took (the settings were refused, the start failed
    first, the device is the CPU)."""
    early, _EARLY[:] = _EARLY[:], []
    _stop(early)


def _stop(early: list[DeviceStream]) -> None:
    """Unregister and stop streams begun early that the start does not take."""
    for stream in early:
        forget_pending(stream.path, stream)
        stream.cancel()
        log.info("weights: stopped the early stream of %s (the start wants another)", stream.path)


def gpu_of(device: str) -> str:
    """The CUDA device a device setting streams to: "auto" is the current one."""
    return "cuda" if device == "auto" else device


def cuda_ordinal(device: str) -> int | None:
    """The CUDA device number a device setting names ("auto" and "cuda": torch's first); None for
    the CPU or a setting that names no CUDA device."""
    if device in ("auto", "cuda"):
        return 0
    kind, _, index = device.partition(":")
    if kind == "cuda" and index.isdigit():
        return int(index)
    return None


def start_weights(
    model_dir: str,
    device: str = "auto",
    start_pages: str | None = None,
    shard: tuple[int, int] = (0, 1),
    want: tuple[str, str | None] | None = None,
) -> str:
    """Set a model's weights moving, before torch is imported: its pack straight to the GPU from a
    separate process (after the start path's recorded pages, `start_pages`, when the disk is cold),
    else its files into the page cache by stdlib threads (on CPU, without a pack or a driver).
    Either way the engine's load_pack of the pack takes what arrived. `shard` (rank, size): under
    tensor parallelism, the rank's own pack. `want`: the engine's (dtype, quantization) settings,
    which pick the pack among several. Returns which one started: "device_stream" or "prefetch"."""
    if device != "cpu":
        gpu = gpu_of(device)
        if start(model_dir, gpu, start_pages=start_pages, shard=shard, want=want) is not None:
            return "device_stream"
    cancel_early()
    prefetch(model_dir, want=want)
    return "prefetch"
