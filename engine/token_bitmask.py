"""The token bitmask of structured outputs between the grammar and the sampler: int32 rows, bit t
of a row allowing token t; filled on the host, carried to the logits' device beside the model's
step, and applied there as -inf on the blocked logits (one Triton kernel on CUDA).
"""

from __future__ import annotations

import torch

try:  # a CPU-only install may have no triton; the torch path masks the logits there
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None


def allocate_bitmask(rows: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """A CPU int32 [rows, ceil(vocab_size / 32)] bitmask, every token allowed; pinned for a
    non-blocking copy to the GPU."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pin_memory)


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}
MASK_BLOCK = 2048  # logits columns per program of the CUDA kernel


if triton is not None:

    @triton.jit
    def _mask_logits_kernel(
        logits_ptr, bitmask_ptr, vocab, words, stride_logits, stride_mask, BLOCK: tl.constexpr
    ):
        """One row, BLOCK columns: -inf where the column's bit is 0 (or past the bitmask); the
        allowed columns are not written."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        in_row = cols < vocab
        word = cols // 32
        bits = tl.load(
            bitmask_ptr + row * stride_mask + word, mask=in_row & (word < words), other=0
        )
        blocked = ((bits >> (cols % 32)) & 1) == 0
        minus_inf = tl.full([BLOCK], float("-inf"), tl.float32)
        tl.store(
            logits_ptr + row * stride_logits + cols,
            minus_inf.to(logits_ptr.dtype.element_ty),
            mask=in_row & blocked,
        )


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits[i, t] = -inf wherever bit t of bitmask row i is 0, in place on the logits' device.

    logits: float [N, V]; bitmask: int32 [N, W] on the same device (a row of all ones leaves its
    logits as they are). Tokens past the bitmask's 32 * W are masked; bits past V are ignored.
    On CUDA one Triton kernel that writes only the blocked columns; elsewhere a few torch ops. It
    never reads the device, so it runs after the decode CUDA graph without a sync."""
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(
            f"apply_token_bitmask: logits {list(logits.shape)} and bitmask "
            f"{list(bitmask.shape)} must be [N, V] and [N, W]"
        )
    if bitmask.dtype != torch.int32 or bitmask.device != logits.device:
        raise ValueError(
            f"apply_token_bitmask: bitmask must be int32 on {logits.device}, got "
            f"{bitmask.dtype} on {bitmask.device}"
        )
    rows, vocab = logits.shape
    if (
        triton is not None
        and logits.is_cuda
        and logits.stride(1) == 1
        and bitmask.stride(1) == 1
        and rows
        and vocab
    ):
        return _apply_token_bitmask_triton(logits, bitmask)
    return _apply_token_bitmask_torch(logits, bitmask)


def _apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    _mask_logits_kernel[(rows, triton.cdiv(vocab, MASK_BLOCK))](
        logits,
        bitmask,
        vocab,
        bitmask.shape[1],
        logits.stride(0),
        bitmask.stride(0),
        BLOCK=MASK_BLOCK,
        num_warps=4,
    )
    return logits


def _apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[1]
    covered = min(vocab, bitmask.shape[1] * 32)
    if covered < vocab:
        logits[:, covered:] = float("-inf")
    shifts = _BIT_SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _BIT_SHIFTS[logits.device] = torch.arange(
            32, dtype=torch.int32, device=logits.device
        )
    words = (covered + 31) // 32
    bits = (
        bitmask[:, :words, None] >> shifts
    ) & 1  # [N, words, 32]: bit j of word w is token 32w + j
    blocked = bits.view(bitmask.shape[0], words * 32)[:, :covered] == 0
    logits[:, :covered].masked_fill_(blocked, float("-inf"))
    return logits


class BitmaskStaging:
    """A step's bitmask rows on their way to the device: host_rows(n) for the grammar to fill (a
    pinned buffer on CUDA), to_device(n) copies them on a stream of their own, so the copy runs
    while the model does and the sampling stream waits only for it; used() after the sampler's
    launch marks the device rows read. Buffers grow to the largest batch seen (at least
    min_rows)."""

    def __init__(self, vocab_size: int, device: torch.device, min_rows: int = 1):
        self.words = (vocab_size + 31) // 32
        self.device = device
        self._min_rows = min_rows
        self._host: torch.Tensor | None = None
        self._on_device: torch.Tensor | None = None
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._copied: torch.cuda.Event | None = None  # the host rows have left
        self._read: torch.cuda.Event | None = None  # the sampler has read the device rows

    def host_rows(self, n: int) -> torch.Tensor:
        """Rows [0, n) of the host buffer, free to write (the last copy out of them is done)."""
        if self._copied is not None:
            self._copied.synchronize()
        if self._host is None or self._host.shape[0] < n:
            size = max(n, self._min_rows)
            pinned = self._stream is not None
            self._host = allocate_bitmask(size, 32 * self.words, pin_memory=pinned)
            if self._stream is not None:
                self._on_device = torch.empty_like(self._host, device=self.device)
                # the new device rows come from the current stream's pool: the first copy into
                # them waits for what that stream has queued
                self.used()
        return self._host[:n]

    def to_device(self, n: int) -> torch.Tensor:
        """The filled rows [0, n) where the logits are: the host rows themselves off CUDA; on CUDA
        a copy queued on the staging stream, which the current stream waits for."""
        if self._stream is None:
            return self._host[:n]
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            if self._read is not None:
                self._stream.wait_event(self._read)  # the last step's sampler is done with them
            rows = self._on_device[:n]
            rows.copy_(self._host[:n], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(self._stream)
        main.wait_event(self._copied)
        return rows

    def used(self) -> None:
        """The sampler's reads of the device rows are queued on the current stream."""
        if self._stream is not None:
            self._read = torch.cuda.Event()
            self._read.record(torch.cuda.current_stream(self.device))
