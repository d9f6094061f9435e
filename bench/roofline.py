"""Memory-bandwidth rooflines: the copy bandwidth measured in the run, bytes a decode step must
read, and the steady decode window of a batch reconstructed from client-side token timestamps.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from bench.checkpoint import hf_tensor_shapes
from bench.timing import RequestRecord
from engine.config import ModelConfig

EMBEDDING = "model.embed_tokens.weight"


def copy_bandwidth(device: str, nbytes: int, repeats: int = 10) -> float:
    """Bytes read + written per second by a device-to-device copy (the ceiling weights stream from
    memory at)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        if src.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / statistics.median(times)


@dataclass(frozen=True)
class ModelBytes:
    weights: int  # every parameter
    # read once per decode step: all but an untied embedding table (only gathered)
    decode_weights: int
    kv_per_token: int  # K and V of one token in every layer

    def step_floor_s(self, kv_tokens: float, bandwidth: float) -> float:
        return (self.decode_weights + kv_tokens * self.kv_per_token) / bandwidth


def model_bytes(config: dict, dtype: torch.dtype) -> ModelBytes:
    """Byte counts from the HF config, with the tensor names and shapes the checkpoint carries."""
    shapes = hf_tensor_shapes(config)
    size = dtype.itemsize
    numel = {name: _numel(shape) for name, shape in shapes.items()}
    weights = sum(numel.values()) * size
    tied = bool(config.get("tie_word_embeddings", False))
    # tied: the table is the lm_head, read whole
    decode = weights - (0 if tied else numel[EMBEDDING] * size)
    m = ModelConfig.from_dict(config)
    return ModelBytes(weights, decode, 2 * m.num_layers * m.num_kv_heads * m.head_dim * size)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def decode_window(
    records: list[RequestRecord],
    end_limit: float | None,
    mb: ModelBytes,
    bandwidth: float,
    min_steps: int = 4,
) -> dict:
    """Mean decode step time of the window where every request has its first token and none has
    finished (cut at end_limit, e.g. the first preemption), against the floor of weights + KV read
    per step.

    Derivation: a request running through the window emits one token per step, so the window holds
    steps = max over requests of its tokens in the window; step time = window / steps. A token at
    output index j of a request with prompt length P was produced by a step that read P + j tokens
    of its KV, so the KV tokens read per step = sum of (P + j) over the window's tokens / steps, and
    the floor = (decode weights + that x KV bytes per token) / copy bandwidth."""
    done = [r for r in records if r.chunks]
    if not done:
        return {"valid": False, "reason": "no tokens"}
    t0 = max(r.first_token_time for r in done)
    t1 = min(r.last_token_time for r in done)
    if end_limit is not None:
        t1 = min(t1, end_limit)
    per_request, tokens, kv_tokens = [], 0, 0
    for r in done:
        inside = [(j, t) for j, t in r.token_times() if t0 < t <= t1]
        per_request.append(len(inside))
        tokens += len(inside)
        kv_tokens += sum(r.prompt_len + j for j, _ in inside)
    steps = max(per_request) if per_request else 0
    if t1 <= t0 or steps < min_steps:
        return {
            "valid": False,
            "reason": f"no steady decode window ({steps} steps between the last first token "
            f"and the first finish or preemption)",
        }
    step_s = (t1 - t0) / steps
    kv_per_step = kv_tokens / steps
    floor_s = mb.step_floor_s(kv_per_step, bandwidth)
    return {
        "valid": True,
        "window_s": t1 - t0,
        "steps": steps,
        "mean_batch": tokens / steps,
        "kv_tokens_per_step": kv_per_step,
        "kv_GB_per_step": kv_per_step * mb.kv_per_token / 1e9,
        "weights_GB_per_step": mb.decode_weights / 1e9,
        "step_ms": step_s * 1e3,
        "floor_ms": floor_s * 1e3,
        "roofline_frac": floor_s / step_s,
    }
