"""Benchmark workloads: prompt/output lengths drawn from the Azure conversation trace, and
random-token prompts.

Everything is seeded, so the same arguments give the same requests on every machine and in every
part of a run.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path

import torch

CONV_TRACE = Path(__file__).resolve().parent / "data" / "AzureLLMInferenceTrace_conv.csv"


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    # forced: the request runs with max_tokens = min_tokens = output_len and ignore_eos
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def load_trace(path: str | Path = CONV_TRACE) -> list[tuple[int, int]]:
    """(ContextTokens, GeneratedTokens) of every row of an Azure LLM inference trace CSV, in file
    order."""
    with open(path, newline="") as f:
        return [
            (int(row["ContextTokens"]), int(row["GeneratedTokens"])) for row in csv.DictReader(f)
        ]


def sample_lengths(
    n: int, seed: int, max_prompt: int, max_output: int, trace: list[tuple[int, int]] | None = None
) -> list[tuple[int, int]]:
    """n (prompt_len, output_len) pairs drawn from the trace without replacement (with it past the
    trace's size), each clamped to [1, max_prompt] and [1, max_output]."""
    if max_prompt < 1 or max_output < 1:
        raise ValueError(f"max_prompt/max_output: must be >= 1, got {max_prompt}/{max_output}")
    rows = load_trace() if trace is None else trace
    rng = random.Random(seed)
    picked = rng.sample(rows, n) if n <= len(rows) else rng.choices(rows, k=n)
    return [(min(max(p, 1), max_prompt), min(max(o, 1), max_output)) for p, o in picked]


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    """length token ids uniform in [0, vocab_size), fixed by the seed (random ids never share a
    cached prefix)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=gen).tolist()


def make_requests(lengths: list[tuple[int, int]], vocab_size: int, seed: int) -> list[BenchRequest]:
    """One request per (prompt_len, output_len), prompt i seeded by (seed, i)."""
    return [
        BenchRequest(random_prompt(p, vocab_size, seed * 1_000_003 + i), o)
        for i, (p, o) in enumerate(lengths)
    ]


def conv_requests(
    n: int, vocab_size: int, seed: int, max_prompt: int, max_output: int
) -> list[BenchRequest]:
    return make_requests(sample_lengths(n, seed, max_prompt, max_output), vocab_size, seed)


def fixed_requests(
    n: int, prompt_len: int, output_len: int, vocab_size: int, seed: int
) -> list[BenchRequest]:
    return make_requests([(prompt_len, output_len)] * n, vocab_size, seed)


def running_contexts(
    n: int,
    seed: int,
    max_prompt: int = 4096,
    max_output: int = 1024,
    trace: list[tuple[int, int]] | None = None,
) -> list[int]:
    """Context lengths of n sequences caught in the middle of decoding under a closed-loop load on
    the conv trace (or `trace`'s rows): a request is running in proportion to its output length,
    and is caught at a uniform point of that output (prompt + 1 .. prompt + output tokens)."""
    rows = load_trace() if trace is None else trace
    rows = [(min(max(p, 1), max_prompt), min(max(o, 1), max_output)) for p, o in rows]
    rng = random.Random(seed)
    picked = rng.choices(rows, weights=[o for _, o in rows], k=n)
    return [p + rng.randint(1, o) for p, o in picked]
