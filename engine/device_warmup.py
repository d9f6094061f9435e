"""Device work that the first request would otherwise pay, begun on a thread right after `import
torch` while the start's Python goes on (Triton's and the engine's imports, the model's build).

cuBLAS sets itself up on its first GEMM in a process: its handle and cublasLt's, the workspace, the
first kernels' modules loaded. A start that leaves this to the first prefill spends it between
ready and the first token. torch lets go of the interpreter's lock inside its ops, so a thread can
run that first GEMM beside the start's Python, and cuBLAS's setup is process-wide: the engine's
thread then finds it done.

Triton's runtime sets itself up at a process's first kernel launch: its driver's C helpers (found
by a `file` subprocess's answer in the on-disk cache, then loaded) and ptxas's version (two
subprocesses, for the compiler's cache key). begin_triton() does it on a thread; the subprocesses'
waits leave the interpreter to the start. Imports torch and the config only (Triton on the thread).
"""

from __future__ import annotations

import logging
import threading

import torch

from engine.config import EngineArgs, ModelConfig, resolve_dtype

log = logging.getLogger(__name__)

# Rows of the warm-up GEMM: a prompt's prefill size (a one-row input takes Triton's GEMV instead).
WARMUP_ROWS = 128


def begin_cublas(args: EngineArgs) -> threading.Thread | None:
    """Start cuBLAS's first-use setup for the model `args` names (its dtype and hidden size) on a
    thread; join it before the engine's first step. None off CUDA or where the config can't be read
    (the engine's own load then reports it)."""
    try:
        device = args.torch_device()
        if device.type != "cuda":
            return None
        config = ModelConfig.from_dir(args.model)
        dtype = resolve_dtype(args.dtype, config, device)
    except Exception as exc:  # noqa: BLE001 - only a head start
        log.debug("cuBLAS: no warm-up (%s: %s)", type(exc).__name__, exc)
        return None
    thread = threading.Thread(
        target=_first_gemm,
        args=(device, dtype, config.hidden_size),
        name="coldbrew-cublas",
        daemon=True,
    )
    thread.start()
    return thread


def _first_gemm(device: torch.device, dtype: torch.dtype, width: int) -> None:
    try:
        with torch.cuda.device(device):
            x = torch.zeros(WARMUP_ROWS, width, dtype=dtype, device=device)
            w = torch.zeros(width, width, dtype=dtype, device=device)
            torch.nn.functional.linear(x, w)
            torch.cuda.current_stream(device).synchronize()
    except Exception as exc:  # noqa: BLE001 - the engine's own first GEMM reports a real failure
        log.debug("cuBLAS warm-up: %s: %s", type(exc).__name__, exc)


def begin_triton(args: EngineArgs) -> threading.Thread | None:
    """Start Triton's runtime setup for `args`' device on a thread; join it before anything launches
    a Triton kernel (Triton's driver object is made once, unguarded). None off CUDA."""
    try:
        device = args.torch_device()
    except Exception as exc:  # noqa: BLE001 - only a head start
        log.debug("Triton: no runtime setup ahead (%s: %s)", type(exc).__name__, exc)
        return None
    if device.type != "cuda":
        return None
    thread = threading.Thread(
        target=_triton_runtime, args=(device,), name="coldbrew-triton", daemon=True
    )
    thread.start()
    return thread


def _triton_runtime(device: torch.device) -> None:
    try:
        from triton.backends.nvidia.compiler import get_ptxas_version
        from triton.runtime.driver import driver

        with torch.cuda.device(device):
            target = driver.active.get_current_target()  # the driver and its C helpers
        get_ptxas_version(target.arch)
    except Exception as exc:  # noqa: BLE001 - the first launch meets (and reports) a real failure
        log.debug("Triton runtime setup: %s: %s", type(exc).__name__, exc)
