"""Triton's compiler key, computed by a second interpreter while this one imports torch.

triton.runtime.cache.triton_key hashes Triton's own sources and shared library before the first
kernel of a process can be looked up in the on-disk cache, inside the first forward. A thread of
this process could compute it too, but loading Triton there holds this interpreter's lock and slows
`import torch` about as much as it saves; a second interpreter does not. Its answer is Triton's own
function's, run in the same environment a moment earlier; install() hands it to Triton. The start
sequence (warmup.start) begins it before `import torch`. Imports no torch.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys

log = logging.getLogger(__name__)

_KEY_CODE = "from triton.runtime.cache import triton_key; print(triton_key())"


class TritonKey:
    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _KEY_CODE],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        self._key: str | None = None  # its answer, once read

    def install(self, timeout: float = 30.0) -> bool:
        """Give Triton the key computed meanwhile (waits for it if need be); False if there is none
        to give."""
        if self._key is None:
            try:
                out, _ = self._proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
                out = b""
            self._key = out.decode().strip() if self._proc.returncode == 0 else ""
        key = self._key
        if not key:
            return False
        try:
            import triton.runtime.cache as triton_cache
        except ImportError:
            return False
        original = getattr(triton_cache, "triton_key", None)
        # another Triton: leave it alone
        if original is None or not hasattr(original, "cache_info"):
            return False
        if original.cache_info().currsize:  # already computed in this process
            return True
        known = functools.lru_cache(maxsize=None)(lambda: key)
        triton_cache.triton_key = known
        autotuner = sys.modules.get("triton.runtime.autotuner")  # imported the name before this ran
        if autotuner is not None and getattr(autotuner, "triton_key", None) is original:
            autotuner.triton_key = known
        log.debug("Triton's compiler key installed")
        return True


_started: TritonKey | None = None


def start_triton_key() -> TritonKey | None:
    """Begin computing the key (once per process: a later call returns the same one); call before
    `import torch`, and install() before the engine's first kernel. None without an NVIDIA driver:
    the CPU engine runs no Triton kernel."""
    global _started
    if _started is None and os.path.exists("/dev/nvidiactl"):
        _started = TritonKey()
    return _started
