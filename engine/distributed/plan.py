"""The step plan rank 0 broadcasts to the other tensor-parallel ranks: what each step runs (token
ids, each sequence's start and length, block tables, the rows that need logits, the ids still on the
device), packed as one int64 array and sent over a gloo group with the host commands (capture
graphs, stop)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from itertools import chain

import numpy as np
import torch
import torch.distributed as dist

STEP, CAPTURE, STOP = 1, 2, 3
# The followers wait for rank 0's next command between requests, idle for as long as the worker is.
IDLE_TIMEOUT = timedelta(days=365)
# num_seqs, num_tokens, logit rows, pending ids, the previous step's sampled rows, table entries
_HEADER = 6


@dataclass
class StepPlan:
    """One step: sequence i adds lens[i] tokens from position starts[i]; ids are all of them in
    order."""

    ids: list[int] | np.ndarray
    starts: list[int]
    lens: list[int]
    tables: list[list[int]] | list[np.ndarray]
    logit_rows: list[int]  # rows of the step's hidden states that need logits
    fill_dst: list[int]  # input rows whose token the previous step sampled (only on the device) ...
    fill_src: list[int]  # ... and its row in that step's sampled ids
    prev_rows: int = 0  # ids the previous step sampled (rank 0 broadcasts them for fill_dst)
    positions: list[int] | np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.positions is None:
            lens = np.asarray(self.lens, dtype=np.int64)
            first = np.cumsum(lens) - lens
            offsets = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(first, lens)
            self.positions = offsets + np.repeat(np.asarray(self.starts, dtype=np.int64), lens)

    def encode(self) -> np.ndarray:
        b, t = len(self.lens), len(self.ids)
        table_lens = [len(x) for x in self.tables]
        head = [b, t, len(self.logit_rows), len(self.fill_dst), self.prev_rows, sum(table_lens)]
        parts = chain(
            head,
            self.lens,
            self.starts,
            self.ids,
            table_lens,
            chain.from_iterable(self.tables),
            self.logit_rows,
            self.fill_dst,
            self.fill_src,
        )
        return np.fromiter(parts, dtype=np.int64)

    @classmethod
    def decode(cls, body: np.ndarray) -> "StepPlan":
        b, t, n_logits, n_fill, prev_rows, n_table = (int(v) for v in body[:_HEADER])
        cuts = np.cumsum([_HEADER, b, b, t, b, n_table, n_logits, n_fill, n_fill])
        sections = np.split(body[: cuts[-1]], cuts[:-1])[1:]
        lens, starts, ids, table_lens, flat, logit_rows, dst, src = sections
        tables = np.split(flat, np.cumsum(table_lens)[:-1]) if b else []
        return cls(
            ids,
            starts.tolist(),
            lens.tolist(),
            tables,
            logit_rows.tolist(),
            dst.tolist(),
            src.tolist(),
            prev_rows,
        )


class PlanChannel:
    """Rank 0 sends (kind, int64 body); every other rank receives them in order. Each message is two
    broadcasts on a gloo group: its kind and length, then its body."""

    def __init__(self, group) -> None:
        self.group = group
        self._head = torch.zeros(2, dtype=torch.int64)

    def send(self, kind: int, body: np.ndarray | None = None) -> None:
        body = np.zeros(0, dtype=np.int64) if body is None else body
        self._head[0], self._head[1] = kind, body.size
        dist.broadcast(self._head, src=0, group=self.group)
        if body.size:
            dist.broadcast(torch.from_numpy(body), src=0, group=self.group)

    def recv(self) -> tuple[int, np.ndarray]:
        dist.broadcast(self._head, src=0, group=self.group)
        kind, n = int(self._head[0]), int(self._head[1])
        body = torch.empty(n, dtype=torch.int64)
        if n:
            dist.broadcast(body, src=0, group=self.group)
        return kind, body.numpy()
