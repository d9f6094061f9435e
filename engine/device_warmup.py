"""Device work that the first request would otherwise pay, begun on a thread right after `import
torch` while the start's Python goes on (Triton's and the engine's imports, the model's build).

cuBLAS sets itself up on its first GEMM in a process: its handle and cublasLt's, the workspace, and
on each new shape its choice of kernel and that kernel's module loaded. A start that leaves this to
the first prefill spends it between ready and the first token. torch lets go of the interpreter's
lock inside its ops, so a thread can run those GEMMs beside the start's Python, and cuBLAS's setup
is process-wide: the engine's thread then finds it done. The thread runs one GEMM of a prompt's
size for each of the model's bf16/fp16 linear shapes (warmup_shapes). Imports torch and the config
only.
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
    shapes = warmup_shapes(config, args.tensor_parallel_size, args.quantization)
    thread = threading.Thread(
        target=_first_gemms,
        args=(device, dtype, shapes),
        name="coldbrew-cublas",
        daemon=True,
    )
    thread.start()
    return thread


def warmup_shapes(
    config: ModelConfig, tp_size: int = 1, quantization: str | None = None
) -> list[tuple[int, int]]:
    """(out_features, in_features) of each distinct linear a prompt's prefill runs through cuBLAS on
    one rank: attention's qkv and o_proj, and the dense MLP's gate_up and down, or a mixture of
    experts' router and shared expert (its experts run in Triton). Quantized linears run other
    kernels: only the first GEMM that sets cuBLAS up is left for them."""
    hidden = config.hidden_size
    if quantization or config.checkpoint_fp8 is not None:
        return [(hidden, hidden)]
    q = config.num_heads * config.head_dim // tp_size
    kv = max(1, config.num_kv_heads // tp_size) * config.head_dim
    shapes = [(q + 2 * kv, hidden), (hidden, q)]
    moe = config.moe
    if moe is None or moe.dense_layers:
        inter = config.intermediate_size // tp_size
        shapes += [(2 * inter, hidden), (hidden, inter)]
    if moe is not None:
        shapes.append((moe.num_experts, hidden))
        if moe.shared_expert_intermediate_size:
            shared = moe.shared_expert_intermediate_size
            shapes += [(2 * shared, hidden), (hidden, shared), (1, hidden)]
    return list(dict.fromkeys(shapes))


def _first_gemms(device: torch.device, dtype: torch.dtype, shapes: list[tuple[int, int]]) -> None:
    """One GEMM of WARMUP_ROWS rows per shape, over uninitialized memory (the products are thrown
    away), the weights as views into one buffer of the largest."""
    try:
        with torch.cuda.device(device):
            weights = torch.empty(max(n * k for n, k in shapes), dtype=dtype, device=device)
            rows = torch.empty(WARMUP_ROWS * max(k for _, k in shapes), dtype=dtype, device=device)
            for n, k in shapes:
                x = rows[: WARMUP_ROWS * k].view(WARMUP_ROWS, k)
                torch.nn.functional.linear(x, weights[: n * k].view(n, k))
            torch.cuda.current_stream(device).synchronize()
    except Exception as exc:  # noqa: BLE001 - the engine's own first GEMM reports a real failure
        log.debug("cuBLAS warm-up: %s: %s", type(exc).__name__, exc)
