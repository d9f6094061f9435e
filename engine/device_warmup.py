"""Device work that the first request would otherwise pay, begun on a thread right after `import
torch` while the start's Python goes on (Triton's and the engine's imports, the model's build).

cuBLAS sets itself up on its first GEMM in a process: its handle and cublasLt's, the workspace, the
first kernels' modules loaded. A start that leaves this to the first prefill spends it between
ready and the first token. torch lets go of the interpreter's lock inside its ops, so a thread can
run that first GEMM beside the start's Python, and cuBLAS's setup is process-wide: the engine's
thread then finds it done. Imports torch and the config only.
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
