"""The few CUDA driver calls the device stream needs, through ctypes: no torch, so a process can use
them at once.

Contexts, pinned host memory, async host-to-device copies, events, and virtual-memory allocations
that another process can map (exported as a POSIX file descriptor). Every failing call raises
CudaError naming the call.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

# Enum values from cuda.h (stable across CUDA 11.x-13.x)
_ALLOCATION_TYPE_PINNED = 1
_HANDLE_TYPE_POSIX_FD = 1
_LOCATION_TYPE_DEVICE = 1
_ACCESS_READWRITE = 3
_GRANULARITY_RECOMMENDED = 1
_STREAM_NON_BLOCKING = 1
_EVENT_DISABLE_TIMING = 2
_ERROR_NOT_READY = 600


class CudaError(RuntimeError):
    """A driver call failed (or the driver is not there)."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_LIB: Any = None


def _lib():
    global _LIB
    if _LIB is None:
        try:
            _LIB = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaError(f"the CUDA driver (libcuda.so.1) is not available: {e}") from None
    return _LIB


def load() -> bool:
    """Load the driver library into this process if it is not yet; False where there is none."""
    try:
        _lib()
    except CudaError:
        return False
    return True


def _call(name: str, *args) -> None:
    # ctypes releases the GIL for the call: a thread waiting on the driver never holds up the
    # interpreter
    rc = getattr(_lib(), name)(*args)
    if rc != 0:
        raise CudaError(f"{name} failed: {_error_string(rc)}")


def _error_string(rc: int) -> str:
    text = ctypes.c_char_p()
    try:
        _lib().cuGetErrorString(rc, ctypes.byref(text))
    except (AttributeError, OSError):
        pass
    return f"{text.value.decode() if text.value else 'CUDA error'} ({rc})"


def _u64(value: int) -> ctypes.c_uint64:
    return ctypes.c_uint64(value)


_ATTRIBUTE_COMPUTE_MODE = 20
_COMPUTE_MODE_DEFAULT = 0


# ---- context -------------------------------------------------------------------------------------
def check_shared_compute_mode(ordinal: int) -> None:
    """Raise CudaError unless the GPU lets several processes hold contexts at once (compute mode
    "default"): in exclusive-process mode a second process's context would keep the worker itself
    off the GPU."""
    _call("cuInit", 0)
    dev = ctypes.c_int()
    _call("cuDeviceGet", ctypes.byref(dev), ordinal)
    mode = ctypes.c_int()
    _call("cuDeviceGetAttribute", ctypes.byref(mode), _ATTRIBUTE_COMPUTE_MODE, dev)
    if mode.value != _COMPUTE_MODE_DEFAULT:
        raise CudaError(
            f"GPU {ordinal} is in compute mode {mode.value}, not the default shared mode: a second "
            f"process may not hold a context beside the worker"
        )


def primary_context(ordinal: int) -> ctypes.c_void_p:
    """Initialise the driver and make `ordinal`'s primary context (the one torch uses) current on
    this thread."""
    _call("cuInit", 0)
    dev = ctypes.c_int()
    _call("cuDeviceGet", ctypes.byref(dev), ordinal)
    ctx = ctypes.c_void_p()
    _call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    _call("cuCtxSetCurrent", ctx)
    return ctx


_context_threads: dict[int, threading.Thread] = {}  # begin_primary_context's, by ordinal
_context_lock = threading.Lock()


def begin_primary_context(ordinal: int) -> threading.Thread:
    """primary_context(ordinal) on a daemon thread: the context is made while the calling thread
    goes on (these calls leave the interpreter free). A later primary_context() finds it made, or
    waits inside the driver while it is being made; a failure here is left for that call to meet.
    Once per device in a process: a later call returns the first call's thread."""

    def make() -> None:
        try:
            primary_context(ordinal)
        except (CudaError, OSError):
            pass

    with _context_lock:
        thread = _context_threads.get(ordinal)
        if thread is None:
            thread = threading.Thread(target=make, name="coldbrew-cuda-context", daemon=True)
            _context_threads[ordinal] = thread
            thread.start()
    return thread


def set_current(ctx: ctypes.c_void_p) -> None:
    _call("cuCtxSetCurrent", ctx)


def pci_bus_id(ordinal: int) -> str:
    """The device's PCI bus id: two processes name the same GPU by it whatever their device
    numbering."""
    dev = ctypes.c_int()
    _call("cuDeviceGet", ctypes.byref(dev), ordinal)
    buf = ctypes.create_string_buffer(32)
    _call("cuDeviceGetPCIBusId", buf, 32, dev)
    return buf.value.decode().lower()


# ---- pinned host memory, streams, events, copies -------------------------------------------------
def host_alloc(nbytes: int) -> int:
    ptr = ctypes.c_void_p()
    _call("cuMemHostAlloc", ctypes.byref(ptr), ctypes.c_size_t(nbytes), 0)
    return ptr.value


def host_free(ptr: int) -> None:
    _call("cuMemFreeHost", ctypes.c_void_p(ptr))


def stream_create() -> ctypes.c_void_p:
    s = ctypes.c_void_p()
    _call("cuStreamCreate", ctypes.byref(s), _STREAM_NON_BLOCKING)
    return s


def event_create() -> ctypes.c_void_p:
    e = ctypes.c_void_p()
    _call("cuEventCreate", ctypes.byref(e), _EVENT_DISABLE_TIMING)
    return e


def event_record(event: ctypes.c_void_p, stream: ctypes.c_void_p) -> None:
    _call("cuEventRecord", event, stream)


def event_synchronize(event: ctypes.c_void_p) -> None:
    _call("cuEventSynchronize", event)


def copy_to_device_async(dst: int, src: int, nbytes: int, stream: ctypes.c_void_p) -> None:
    _call("cuMemcpyHtoDAsync_v2", _u64(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes), stream)


# ---- shareable device memory (virtual memory management) -----------------------------------------
def _prop(ordinal: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = _ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = _HANDLE_TYPE_POSIX_FD
    prop.location = _Location(_LOCATION_TYPE_DEVICE, ordinal)
    return prop


def granularity(ordinal: int) -> int:
    g = ctypes.c_size_t()
    prop = _prop(ordinal)
    _call(
        "cuMemGetAllocationGranularity",
        ctypes.byref(g),
        ctypes.byref(prop),
        _GRANULARITY_RECOMMENDED,
    )
    return g.value


def create_shareable(ordinal: int, size: int) -> tuple[int, int]:
    """Device memory of `size` bytes (a multiple of granularity()) -> (allocation handle, POSIX fd
    exporting it)."""
    handle = ctypes.c_uint64()
    prop = _prop(ordinal)
    _call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), _u64(0))
    fd = ctypes.c_int(-1)
    try:
        _call(
            "cuMemExportToShareableHandle", ctypes.byref(fd), handle, _HANDLE_TYPE_POSIX_FD, _u64(0)
        )
    except CudaError:
        release(handle.value)
        raise
    return handle.value, fd.value


def import_shareable(fd: int) -> int:
    """The allocation another process exported as `fd` -> a handle of this process (the fd may be
    closed after)."""
    handle = ctypes.c_uint64()
    _call(
        "cuMemImportFromShareableHandle",
        ctypes.byref(handle),
        ctypes.c_void_p(fd),
        _HANDLE_TYPE_POSIX_FD,
    )
    return handle.value


def map_handle(handle: int, size: int, ordinal: int) -> int:
    """Reserve addresses, map the allocation there and give `ordinal` read/write access; returns the
    address."""
    ptr = ctypes.c_uint64()
    _call(
        "cuMemAddressReserve",
        ctypes.byref(ptr),
        ctypes.c_size_t(size),
        ctypes.c_size_t(0),
        _u64(0),
        _u64(0),
    )
    try:
        _call("cuMemMap", ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), _u64(handle), _u64(0))
    except CudaError:
        _call("cuMemAddressFree", ptr, ctypes.c_size_t(size))
        raise
    try:
        desc = _AccessDesc(_Location(_LOCATION_TYPE_DEVICE, ordinal), _ACCESS_READWRITE)
        _call("cuMemSetAccess", ptr, ctypes.c_size_t(size), ctypes.byref(desc), ctypes.c_size_t(1))
    except CudaError:
        unmap(ptr.value, size)
        raise
    return ptr.value


def unmap(ptr: int, size: int) -> None:
    """Unmap and free the addresses (the memory itself lives while any handle or mapping of it
    remains)."""
    try:
        _call("cuMemUnmap", _u64(ptr), ctypes.c_size_t(size))
    finally:
        _call("cuMemAddressFree", _u64(ptr), ctypes.c_size_t(size))


def release(handle: int) -> None:
    _call("cuMemRelease", _u64(handle))
