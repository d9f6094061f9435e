"""A packed step's trip from its pinned host buffer to the device, as one Triton kernel.

The kernel reads the pinned buffer over PCIe (pinned memory is mapped into the device's address
space) and writes the device buffer, putting the ids the previous step sampled, which only the
device holds, into their input rows on the way. Between two decode steps this replaces a host-to-
device copy and a device-to-device copy: each copy-engine operation between kernels left the GPU
idle for a few microseconds (bench/results/2026-11-28-h100-step-transfer/). Only small steps take
it (the latency of a few sequences, where the GPU waits on the copies): its launch costs the host
more than a copy's, and a loaded engine's host has none to spare.
"""

from __future__ import annotations

import logging

import torch

try:  # a CPU-only install may have no triton; its steps never leave the host
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None

ENABLED = True  # benchmarks turn it off to compare with the copy engine's copies
BLOCK = 1024  # 8-byte words a program moves
# Steps of at most this many tokens (or sampled rows: engine.sampling's copy) count as small.
SMALL_STEP = 8
# Triton's launcher refuses a pointer the device cannot address with this message
_UNMAPPED = "cannot be accessed from Triton"
_host_readable = [True]  # False once a launch found pinned memory outside the device's reach
log = logging.getLogger(__name__)


def applies(dest: torch.Tensor, num_tokens: int) -> bool:
    """Whether a step of num_tokens bound for `dest` (a device buffer) moves by the kernel."""
    return (
        ENABLED
        and _host_readable[0]
        and num_tokens <= SMALL_STEP
        and triton is not None
        and dest.is_cuda
    )


def send(
    host_words: torch.Tensor,
    dest_words: torch.Tensor,
    tokens: torch.Tensor | None = None,
    run: tuple[int, int, int] = (0, 0, 0),
) -> bool:
    """dest_words[:] = host_words (int64 words; host_words pinned), except the words dst0 + i for
    i < count, which take tokens[src0 + i] (run = (dst0, src0, count); tokens int64 on the
    device). False, with nothing launched, where the device cannot address pinned host memory
    (then applies() is False from here on: the caller copies)."""
    n = host_words.numel()
    dst0, src0, count = run
    try:
        _send_kernel[(triton.cdiv(n, BLOCK),)](
            host_words,
            dest_words,
            tokens if tokens is not None and count else dest_words,
            n,
            dst0,
            src0,
            count,
            BLOCK=BLOCK,
        )
    except ValueError as exc:
        if _UNMAPPED not in str(exc):
            raise
        _host_readable[0] = False
        log.warning(
            "pinned host memory is not addressable from the device here (%s): step inputs go by "
            "the copy engine",
            exc,
        )
        return False
    return True


if triton is not None:
    # the counts change from step to step: never specialized, so one compiled kernel serves all
    @triton.jit(do_not_specialize=["n_words", "dst0", "src0", "count"])
    def _send_kernel(
        host_ptr, dest_ptr, tokens_ptr, n_words, dst0, src0, count, BLOCK: tl.constexpr
    ):
        """One program per BLOCK words: copy them, a pending id in place of its word."""
        w = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = w < n_words
        words = tl.load(host_ptr + w, mask=inside)
        k = w - dst0
        pending = inside & (k >= 0) & (k < count)
        sampled = tl.load(tokens_ptr + src0 + k, mask=pending)
        tl.store(dest_ptr + w, tl.where(pending, sampled, words), mask=inside)
