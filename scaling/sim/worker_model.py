"""The simulated worker: how many requests one GPU worker holds and how long each takes, read from a
serving benchmark's JSON (its online levels: concurrency against output tokens/s and TTFT).

Which benchmark run is named in bench/results/scaling-worker-model.json, so a newer run is chosen
there, not in code; `--serving-json` overrides it. Nothing here is typed in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parents[2] / "bench" / "results"
WORKER_MODEL_SOURCE = RESULTS_DIR / "scaling-worker-model.json"


def named_serving_json(source: Path = WORKER_MODEL_SOURCE) -> Path:
    """The serving results file that `source` names (its "serving_json", relative to its folder)."""
    try:
        named = json.loads(Path(source).read_text())["serving_json"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{source}: must be a JSON object naming the worker model's serving run "
            f'as {{"serving_json": "<path under {Path(source).parent}>"}} ({exc})'
        )
    return Path(source).parent / named


SERVING_JSON = named_serving_json()


@dataclass(frozen=True)
class WorkerModel:
    """A worker holds up to `capacity` requests. A request admitted as the c-th one on its worker
    takes ttft_s[c] * context / reference_context to its first token, then generated /
    decode_tok_s[c] more seconds."""

    capacity: int
    # index c = 1..capacity (index 0 unused): in-worker TTFT at that concurrency, conv prompts
    ttft_s: np.ndarray
    decode_tok_s: np.ndarray  # per-request decode rate at that concurrency
    reference_context: float  # mean prompt tokens of the benchmark's requests (its TTFT's prompts)
    source: str

    def in_worker_ttft_s(self, concurrency: int, context_tokens: int) -> float:
        return float(self.ttft_s[concurrency]) * max(context_tokens, 1) / self.reference_context

    def service_s(self, concurrency: int, context_tokens: int, generated_tokens: int) -> float:
        """Seconds the request holds its slot: time to first token, then the rest of its tokens."""
        rest = max(generated_tokens - 1, 0) / float(self.decode_tok_s[concurrency])
        return self.in_worker_ttft_s(concurrency, context_tokens) + rest


def load_worker_model(
    path: Path = SERVING_JSON,
    reference_contexts: np.ndarray | None = None,
    capacity: int | None = None,
) -> WorkerModel:
    """The worker model from a `bench.serving` JSON (its `online` levels and KV size).

    capacity defaults to the highest concurrency measured, lowered if the KV cache cannot hold that
    many requests of the benchmark's mean length. reference_contexts: the prompt lengths the
    benchmark drew (the conv trace, clamped to its --max-prompt); their mean scales the measured
    TTFT to a request's own prompt length.
    """
    data = json.loads(Path(path).read_text())
    levels = sorted(data["online"]["levels"], key=lambda lv: lv["concurrency"])
    conc = np.array([lv["concurrency"] for lv in levels], dtype=np.float64)
    tok_s = np.array([lv["output_tok_s"] for lv in levels], dtype=np.float64)
    ttft = np.array([lv["ttft_ms"]["p50"] / 1000.0 for lv in levels], dtype=np.float64)
    args = data["meta"]["calls"][-1]["args"]
    max_prompt = int(args["max_prompt"])
    kv_tokens = int(data["kv"]["decode+fixed+online"]["num_kv_blocks"]) * int(args["block_size"])
    if reference_contexts is None or len(reference_contexts) == 0:
        raise ValueError(
            "reference_contexts: the benchmark's prompt lengths are needed to scale its TTFT"
        )
    ref = float(np.minimum(np.maximum(reference_contexts, 1), max_prompt).mean())
    kv_cap = int(kv_tokens // max(ref, 1.0))
    cap = capacity if capacity is not None else min(int(conc[-1]), kv_cap)
    if cap < 1:
        raise ValueError(f"capacity: must be >= 1, got {cap}")
    c = np.arange(cap + 1, dtype=np.float64)
    c[0] = 1.0
    per_request = np.interp(c, conc, tok_s / conc)  # clamped beyond the measured range
    return WorkerModel(
        capacity=cap,
        ttft_s=np.interp(c, conc, ttft),
        decode_tok_s=per_request,
        reference_context=ref,
        source=f"{Path(path).name}: online levels {conc.astype(int).tolist()}, "
        f"KV {kv_tokens} tokens",
    )
