"""py-cpuinfo's CPU probe, begun at process start and kept for the RunPod SDK.

The SDK calls `cpuinfo.get_cpu_info()` when it is imported: runpod/serverless/utils/rp_debugger.py
(runpod 1.x) reads the CPU's brand into a module constant for its debugger output. py-cpuinfo 9
answers that call by running itself in a new interpreter (`get_cpu_info_json`: `python cpuinfo.py
--json`), which takes about a second. Begun first, on a thread, that subprocess runs beside the
settings and torch's import (its wait releases the interpreter's lock); `cpuinfo.get_cpu_info` then
returns a copy of the same answer, without a second probe. The SDK itself is not changed.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

log = logging.getLogger(__name__)

_begun = False


def begin() -> None:
    """Start the probe on a daemon thread (once), where py-cpuinfo is installed."""
    global _begun
    if _begun:
        return
    try:
        import cpuinfo
    except ImportError:  # no SDK here: nothing will ask
        return
    _begun = True
    probe = cpuinfo.get_cpu_info
    answer: Future = Future()

    def run() -> None:
        t0 = time.perf_counter()
        try:
            answer.set_result(probe())
        except BaseException as exc:  # raised again to whoever asks, as the probe would
            answer.set_exception(exc)
        log.debug("cpu probe: answered in %.2f s", time.perf_counter() - t0)

    def get_cpu_info() -> dict:
        return dict(answer.result())

    get_cpu_info.__doc__ = probe.__doc__
    cpuinfo.get_cpu_info = get_cpu_info
    threading.Thread(target=run, name="cpu-probe", daemon=True).start()
