"""Per-request token timing as a client sees it, and the serving statistics drawn from it
(throughput, TTFT, ITL).

A stream may deliver several tokens in one chunk (a slow reader skips to the newest cumulative
output): a chunk of k new tokens arriving dt after the previous one counts as k inter-token gaps of
dt / k.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    prompt_len: int
    requested_output: int
    submit_time: float
    # (arrival time, cumulative output tokens)
    chunks: list[tuple[float, int]] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, t: float, num_tokens: int) -> None:
        if not self.chunks or num_tokens > self.chunks[-1][1]:
            self.chunks.append((t, num_tokens))

    @property
    def num_output(self) -> int:
        return self.chunks[-1][1] if self.chunks else 0

    @property
    def first_token_time(self) -> float | None:
        return self.chunks[0][0] if self.chunks else None

    @property
    def last_token_time(self) -> float | None:
        return self.chunks[-1][0] if self.chunks else None

    def token_times(self) -> list[tuple[int, float]]:
        """(output index, arrival time) of every token: the tokens of a chunk share its arrival
        time."""
        out, prev = [], 0
        for t, n in self.chunks:
            out.extend((i, t) for i in range(prev, n))
            prev = n
        return out

    def itl_gaps(self, start: float = float("-inf"), end: float = float("inf")) -> list[float]:
        """Inter-token gaps of chunks after the first that arrived within [start, end], each split
        over its tokens."""
        gaps: list[float] = []
        for (t0, n0), (t1, n1) in zip(self.chunks, self.chunks[1:]):
            if start <= t0 and t1 <= end:
                gaps.extend([(t1 - t0) / (n1 - n0)] * (n1 - n0))
        return gaps


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 99)) -> dict[str, float | None]:
    if not values:
        return {f"p{q}": None for q in qs}
    arr = np.asarray(values, dtype=np.float64)
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs}


def _ms(stats: dict[str, float | None]) -> dict[str, float | None]:
    return {k: (None if v is None else v * 1e3) for k, v in stats.items()}


def summarize(records: list[RequestRecord], wall_start: float, wall_end: float) -> dict:
    """Offline statistics of requests that all arrived at wall_start: throughput over the whole wall
    time."""
    wall = max(wall_end - wall_start, 1e-9)
    out_tokens = sum(r.num_output for r in records)
    prompt_tokens = sum(r.prompt_len for r in records)
    ttft = [r.first_token_time - r.submit_time for r in records if r.first_token_time is not None]
    itl = [g for r in records for g in r.itl_gaps()]
    tpot = [
        (r.last_token_time - r.first_token_time) / (r.num_output - 1)
        for r in records
        if r.num_output > 1
    ]
    chunks = sum(len(r.chunks) for r in records)
    return {
        "num_requests": len(records),
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "requested_output_tokens": sum(r.requested_output for r in records),
        "all_lengths_as_requested": all(r.num_output == r.requested_output for r in records),
        "wall_s": wall,
        "output_tok_s": out_tokens / wall,
        "total_tok_s": (out_tokens + prompt_tokens) / wall,
        "request_s": len(records) / wall,
        "ttft_ms": _ms(percentiles(ttft)),
        "itl_ms": _ms(percentiles(itl)),
        "tpot_ms_mean": (float(np.mean(tpot)) * 1e3) if tpot else None,
        "tokens_per_chunk": out_tokens / chunks if chunks else None,
    }


def summarize_window(records: list[RequestRecord], start: float, end: float) -> dict:
    """Steady-state statistics over [start, end]: tokens that arrived in it, TTFT of requests
    submitted in it, inter-token gaps wholly inside it."""
    span = max(end - start, 1e-9)
    out_tokens = sum(1 for r in records for _, t in r.token_times() if start <= t <= end)
    submitted = [r for r in records if start <= r.submit_time <= end]
    ttft = [r.first_token_time - r.submit_time for r in submitted if r.first_token_time is not None]
    itl = [g for r in records for g in r.itl_gaps(start, end)]
    finished = [
        r for r in records if r.finish_reason in ("length", "stop") and r.last_token_time <= end
    ]
    return {
        "window_s": span,
        "requests_submitted": len(submitted),
        "requests_finished": len(finished),
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / span,
        "ttft_ms": _ms(percentiles(ttft)),
        "itl_ms": _ms(percentiles(itl)),
        "finished_lengths_as_requested": all(r.num_output == r.requested_output for r in finished),
    }
