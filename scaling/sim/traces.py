"""The Azure LLM inference traces (2023) as arrays the simulator replays: arrival times and token
counts.

Reads the CSVs kept with their CC-BY attribution in bench/data/ (plain or gzip); time-scales and
slices them.
"""

from __future__ import annotations

import csv
import gzip
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

DATA_DIR = Path(__file__).resolve().parents[2] / "bench" / "data"
TRACE_NAMES = ("code", "conv")


@dataclass(frozen=True)
class Trace:
    """One arrival process: seconds from the first arrival (sorted), prompt and output tokens per
    request."""

    name: str
    arrival_s: np.ndarray  # float64, starts at 0, non-decreasing
    context_tokens: np.ndarray  # int64
    generated_tokens: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def span_s(self) -> float:
        return float(self.arrival_s[-1]) if len(self) else 0.0

    def time_scaled(self, speed: float) -> "Trace":
        """The same requests arriving `speed` times as fast (2.0: twice the rate in half the
        time)."""
        if not speed > 0:
            raise ValueError(f"speed: must be > 0, got {speed}")
        return Trace(
            f"{self.name}@{speed:g}x",
            self.arrival_s / speed,
            self.context_tokens,
            self.generated_tokens,
        )

    def head(self, seconds: float) -> "Trace":
        """The requests that arrive in the first `seconds`."""
        n = int(np.searchsorted(self.arrival_s, seconds, side="right"))
        return Trace(
            self.name, self.arrival_s[:n], self.context_tokens[:n], self.generated_tokens[:n]
        )


def trace_path(name: str, data_dir: Path = DATA_DIR) -> Path:
    if name not in TRACE_NAMES:
        raise ValueError(f"trace: must be one of {TRACE_NAMES}, got {name!r}")
    for suffix in (".csv", ".csv.gz"):
        path = data_dir / f"AzureLLMInferenceTrace_{name}{suffix}"
        if path.exists():
            return path
    raise FileNotFoundError(f"no AzureLLMInferenceTrace_{name}.csv(.gz) under {data_dir}")


def _parse_time(stamp: str) -> float:
    # "2023-11-16 18:17:03.9799600": seven fractional digits; datetime takes at most six
    head, _, frac = stamp.partition(".")
    return datetime.fromisoformat(head).timestamp() + (float("0." + frac) if frac else 0.0)


def load_trace(name: str, data_dir: Path = DATA_DIR) -> Trace:
    """The named trace ('code' or 'conv'), arrivals shifted to start at 0 s."""
    path = trace_path(name, data_dir)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.DictReader(f))
    t = np.array([_parse_time(r["TIMESTAMP"]) for r in rows], dtype=np.float64)
    order = np.argsort(t, kind="stable")
    t = t[order] - t[order[0]]
    ctx = np.array([int(r["ContextTokens"]) for r in rows], dtype=np.int64)[order]
    gen = np.array([int(r["GeneratedTokens"]) for r in rows], dtype=np.int64)[order]
    return Trace(name, t, ctx, gen)
