"""One log line for each Triton kernel this process compiles instead of finding it in the cache.

A kernel compiled while the engine serves is a stall of every running stream (a second or more for
a GEMM); a worker that started from a compiled engine should compile none. install() registers a
listener on Triton's compiler (`triton.knobs.compilation.listener`, called for every kernel the
process loads); cache hits are only counted, misses are logged with their compile time. Kernels the
warm-up compiles in its own process are not this process's and are not logged here.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

_lock = threading.Lock()
counts = {"loaded": 0, "compiled": 0}


def _listener(*, src, metadata, metadata_group, times, cache_hit) -> None:
    with _lock:
        counts["compiled" if not cache_hit else "loaded"] += 1
    if not cache_hit:
        micros = getattr(times, "total", None)  # Triton's CompileTimes, in microseconds
        log.info(
            "kernels: compiled %s in this process (not in Triton's cache)%s",
            getattr(src, "name", "?"),
            f" in {micros / 1e6:.2f} s" if isinstance(micros, (int, float)) else "",
        )


def install() -> bool:
    """Watch Triton's compiles in this process; False where this Triton has no listener hook (or
    another listener is set: it is left alone)."""
    try:
        from triton import knobs
    except ImportError:
        return False
    compilation = getattr(knobs, "compilation", None)
    if compilation is None or not hasattr(compilation, "listener"):
        return False
    if compilation.listener not in (None, _listener):
        return False
    compilation.listener = _listener
    return True
