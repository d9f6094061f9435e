"""One step's model inputs (token ids, positions) and AttentionMetadata, packed with numpy into one
pinned host buffer and sent to the device at once (engine.step_transfer's kernel, which also puts
in the ids the previous step sampled on the device); the CUDA-graph static buffers use the same
layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np
import torch

from engine import step_transfer
from engine.attention import AttentionMetadata

# Bytes between sections: every view is aligned for any dtype and for vectorised kernel loads.
_ALIGN = 64


@dataclass(frozen=True)
class StepLayout:
    """Byte offsets of each section in the packed buffer, for T tokens, B sequences and block tables
    B x W."""

    num_tokens: int
    num_seqs: int
    table_width: int

    def sections(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        t, b, w = self.num_tokens, self.num_seqs, self.table_width
        return [
            ("input_ids", torch.int64, (t,)),
            ("positions", torch.int64, (t,)),
            ("slot_mapping", torch.int64, (t,)),
            ("query_start_loc", torch.int32, (b + 1,)),
            ("seq_lens", torch.int32, (b,)),
            ("block_tables", torch.int32, (b, w)),
        ]

    def offsets(self) -> tuple[dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]], int]:
        """name -> (byte offset, byte size, dtype, shape), and the total size in bytes."""
        return _offsets(self)


@lru_cache(maxsize=4096)
def _offsets(
    layout: StepLayout,
) -> tuple[dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]], int]:
    out, at = {}, 0
    for name, dtype, shape in layout.sections():
        nbytes = math.prod(shape) * dtype.itemsize
        out[name] = (at, nbytes, dtype, shape)
        at += -(-nbytes // _ALIGN) * _ALIGN
    return out, at


@dataclass
class StepTensors:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


def views(buf: torch.Tensor, layout: StepLayout, meta_host: dict) -> StepTensors:
    """Typed views of a packed uint8 buffer (on any device) as the model's inputs and
    AttentionMetadata."""
    offsets, _ = layout.offsets()
    t = {
        name: buf[at : at + n].view(dtype).view(shape)
        for name, (at, n, dtype, shape) in offsets.items()
    }
    meta = AttentionMetadata(
        slot_mapping=t["slot_mapping"],
        query_start_loc=t["query_start_loc"],
        seq_lens=t["seq_lens"],
        block_tables=t["block_tables"],
        **meta_host,
    )
    return StepTensors(t["input_ids"], t["positions"], meta)


@dataclass(frozen=True)
class PendingIds:
    """Input rows whose token the previous step sampled and only the device holds:
    input_ids[dst[i]] = tokens[src[i]] (tokens: that step's sampled ids, int64 on the device)."""

    dst: list[int]
    src: list[int]
    tokens: torch.Tensor

    @cached_property
    def run(self) -> tuple[int, int, int] | None:
        """(dst[0], src[0], count) when dst and src each rise by one, else None (computed once:
        the stager's choice and the write both ask)."""
        dst, src, k = self.dst, self.src, len(self.dst)
        if dst[-1] - dst[0] == k - 1 and src == list(range(src[0], src[0] + k)):
            return dst[0], src[0], k
        return None

    def write(self, input_ids: torch.Tensor) -> None:
        """Put the ids into input_ids (on the tokens' device)."""
        run = self.run
        if run is not None:
            dst0, src0, k = run
            input_ids[dst0 : dst0 + k].copy_(self.tokens[src0 : src0 + k])
            return
        pin = input_ids.is_cuda
        index = torch.tensor([self.dst, self.src], dtype=torch.int64, pin_memory=pin).to(
            input_ids.device, non_blocking=True
        )
        input_ids[index[0]] = self.tokens[index[1]]


def input_ids_view(buf: torch.Tensor, layout: StepLayout) -> torch.Tensor:
    """The input_ids section of a packed buffer, as int64 [num_tokens]."""
    at, n, dtype, shape = layout.offsets()[0]["input_ids"]
    return buf[at : at + n].view(dtype)


def input_ids_word(layout: StepLayout) -> int:
    """Where input_ids begin in a packed buffer seen as int64 words (its section is int64)."""
    return layout.offsets()[0]["input_ids"][0] // 8


class InputStager:
    """Builds packed step inputs in a reusable pinned host buffer (CUDA) and copies them to the
    device at once."""

    def __init__(self, device: torch.device, block_size: int) -> None:
        self.device = device
        self.block_size = block_size
        # Two pinned buffers used in turn, each with the event of the last copy out of it: with
        # steps queued ahead of the GPU, the buffer being rewritten is the one of two steps ago,
        # whose copy has long left it.
        self._hosts: list[torch.Tensor | None] = [None, None]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        if self.device.type != "cuda":
            # the buffer is the step's input itself: a fresh one
            return torch.empty(nbytes, dtype=torch.uint8)
        self._turn ^= 1
        turn = self._turn
        if self._copied[turn] is not None:
            self._copied[
                turn
            ].synchronize()  # its last copy must have left the buffer before it is rewritten
        host = self._hosts[turn]
        if host is None or host.numel() < nbytes:
            host = self._hosts[turn] = torch.empty(
                max(nbytes, 1 << 16) * 2, dtype=torch.uint8, pin_memory=True
            )
        return host

    def stage(
        self,
        token_ids: Sequence[int] | np.ndarray,
        positions: Sequence[int] | np.ndarray,
        starts: Sequence[int],
        lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        table_width: int | None = None,
        pad_to: int | None = None,
        dest: torch.Tensor | None = None,
        max_seq_len: int | None = None,
        want_views: bool = True,
        pad_tokens_to: int | None = None,
        pending: PendingIds | None = None,
    ) -> StepTensors | None:
        """Pack one step and return its device tensors.

        pad_to: add one-token rows up to this many sequences, with seq_len 0, slot -1 and query
        length 1 (the decode graphs' padding). dest: a device uint8 buffer to copy into (a graph's
        static inputs); by default a new one. max_seq_len: override (graphs pass an upper bound,
        their launch must not depend on it).
        want_views: False skips building the returned tensors (a graph replay reads its own static
        views). pad_tokens_to: add tokens of no sequence up to this many (id 0, position 0, slot -1;
        the piecewise graphs' padding); the sequences stay the real ones. pending: ids only the
        device holds, put into the step's input ids.
        """
        bs = self.block_size
        num_real = len(lens)
        num_seqs = pad_to if pad_to is not None else num_real
        lens_np = np.asarray(lens, dtype=np.int64)
        real_tokens = int(lens_np.sum())
        num_tokens = real_tokens + (num_seqs - num_real)
        if pad_tokens_to is not None:
            if pad_to is not None or pad_tokens_to < real_tokens:
                raise ValueError(
                    f"pad_tokens_to={pad_tokens_to}: must be >= the step's {real_tokens} tokens, "
                    "without pad_to"
                )
            num_tokens = pad_tokens_to
        width = (
            table_width
            if table_width is not None
            else max((len(t) for t in block_tables), default=1)
        )
        layout = StepLayout(num_tokens, num_seqs, max(width, 1))
        offsets, nbytes = layout.offsets()
        host = self._host_buffer(nbytes)
        host_np = host.numpy()

        def section(name: str) -> np.ndarray:
            at, n, dtype, shape = offsets[name]
            return host_np[at : at + n].view(_NP[dtype]).reshape(shape)

        tables = section("block_tables")
        tables.fill(0)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = t
        ids = section("input_ids")
        ids[:real_tokens] = token_ids
        ids[real_tokens:] = 0
        pos = section("positions")
        pos[:real_tokens] = positions
        pos[real_tokens:] = 0
        seq_of_token = np.repeat(np.arange(num_real), lens_np)
        pos_real = pos[:real_tokens]
        slots = section("slot_mapping")
        slots[:real_tokens] = (
            tables[seq_of_token, pos_real // bs].astype(np.int64) * bs + pos_real % bs
        )
        slots[real_tokens:] = -1
        qsl = section("query_start_loc")
        qsl[0] = 0
        qsl[1 : num_real + 1] = np.cumsum(lens_np)
        qsl[num_real + 1 :] = qsl[num_real] + np.arange(1, num_seqs - num_real + 1)
        seq_lens = section("seq_lens")
        seq_lens[:num_real] = np.asarray(starts, dtype=np.int64) + lens_np
        seq_lens[num_real:] = 0

        if self.device.type == "cuda":
            if dest is None:
                dest = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            _send(host[:nbytes], dest[:nbytes], layout, pending)
            if self._copied[self._turn] is None:
                self._copied[self._turn] = torch.cuda.Event()
            self._copied[self._turn].record()
        else:
            dest = host[:nbytes]
            if pending is not None:
                pending.write(input_ids_view(dest, layout))
        if not want_views:
            return None
        qsl_list, seq_lens_list = qsl.tolist(), seq_lens.tolist()
        chunks = np.flatnonzero(lens_np != 1)
        meta_host = dict(
            num_decode_seqs=int(chunks[0]) if chunks.size else num_seqs,
            max_query_len=int(lens_np.max(initial=1)) if num_real else 1,
            max_seq_len=max_seq_len if max_seq_len is not None else max(seq_lens_list, default=0),
            query_start_loc_cpu=qsl_list,
            seq_lens_cpu=seq_lens_list,
            block_size=bs,
        )
        return views(dest, layout, meta_host)


def _send(
    host: torch.Tensor, dest: torch.Tensor, layout: StepLayout, pending: PendingIds | None
) -> None:
    """Copy a packed step (pinned host bytes) into its device buffer, with the pending ids: by
    engine.step_transfer's kernel for a small step (ids in a run go in on the way), else by the
    copy engine."""
    run = pending.run if pending is not None else None
    sent = False
    if step_transfer.applies(dest, layout.num_tokens):
        words = (0, 0, 0)
        if run is not None:  # input_ids' words are its rows
            dst0, src0, k = run
            words = (input_ids_word(layout) + dst0, src0, k)
        tokens = pending.tokens if run is not None else None
        sent = step_transfer.send(host.view(torch.int64), dest.view(torch.int64), tokens, words)
    if not sent:
        dest.copy_(host, non_blocking=True)
    if pending is not None and not (sent and run is not None):  # the kernel put in a run only
        pending.write(input_ids_view(dest, layout))


_NP = {torch.int64: np.int64, torch.int32: np.int32}
