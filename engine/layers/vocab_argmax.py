"""The CUDA sampler's last step: per row, the argmax over the vocabulary, of the logits (greedy
rows) or of the logits plus Gumbel noise from a counter-based RNG (Philox; the random draw).

Each row's noise depends only on its own 64-bit key, so a seeded request draws the same tokens
whatever the batch.

A row is split over programs of BLOCK columns each; the last of them to finish picks the row's
winner from their bests: one program per row (and torch's argmax of one row) would walk 128k columns
on one SM (bench/results/2026-11-28-h100-norm-after/). Ties go to the lowest column, as
torch.argmax's; a NaN counts as +inf.
"""

from __future__ import annotations

import torch

try:  # a CPU-only install may have no triton; the CPU sampler never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None

_MASK64 = (1 << 64) - 1
BLOCK = 4096  # columns a program takes: 32 programs a row at a 128k vocabulary


def mix64(z: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of a 64-bit int (used to derive per-draw
    keys)."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def draw_key(generator: torch.Generator) -> int:
    """A signed 64-bit key for one row's draw from a CUDA generator, advancing the generator's
    Philox offset by 4 (one draw), so the next call on the same generator gets a different key.
    Host-only: no kernel, no sync."""
    offset = generator.get_offset()
    generator.set_offset(offset + 4)
    key = mix64(generator.initial_seed() ^ mix64(offset))
    return key - (1 << 64) if key >= (1 << 63) else key


if triton is not None:

    @triton.jit
    def _argmax_kernel(
        logits_ptr, stride_row, keys_ptr, best_ptr, col_ptr, arrivals_ptr, out_ptr, vocab,
        NOISE: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
    ):  # fmt: skip
        """Program (row, chunk): the largest score of the row's columns [chunk * BLOCK, + BLOCK)
        and its lowest column (NOISE: score = logit + Gumbel noise keyed by keys[row]); the last
        of the row's programs to arrive (an atomic count, reset by it) picks the row's winner from
        all of them."""
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        chunks = tl.num_programs(1)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        score = tl.load(
            logits_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf")
        ).to(tl.float32)
        if NOISE:
            u = tl.rand(tl.load(keys_ptr + row), cols)
            # keep log(-log(u)) finite at both ends
            u = tl.minimum(tl.maximum(u, 1.0e-30), 0.99999994)
            score = score - tl.log(-tl.log(u))  # Gumbel-max: a draw from softmax(logit)
        score = tl.where(score != score, float("inf"), score)
        best = tl.max(score, axis=0)
        # masked columns (>= vocab) tie only with a row of -inf, and lose to its real columns
        col = tl.min(tl.where(score == best, cols, vocab), axis=0)
        tl.store(best_ptr + row * chunks + chunk, best)
        tl.store(col_ptr + row * chunks + chunk, col)
        # acq_rel: this program's best is visible before its arrival counts; the last sees all
        if tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel") == chunks - 1:
            c = tl.arange(0, CHUNKS)
            ok = c < chunks
            bests = tl.load(best_ptr + row * chunks + c, mask=ok, other=float("-inf"))
            col_of = tl.load(col_ptr + row * chunks + c, mask=ok, other=vocab)
            top = tl.max(bests, axis=0)
            winner = tl.min(tl.where(bests == top, col_of, vocab), axis=0)
            tl.store(out_ptr + row, winner.to(tl.int64))
            tl.atomic_xchg(arrivals_ptr + row, 0)  # ready for the next launch


# per device: one zeroed arrival count per row, grown as batches grow (the kernel leaves it
# zero); launches that share a device take turns (the engine samples on one stream)
_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def _arrivals(rows: int, device: torch.device) -> torch.Tensor:
    counts = _ARRIVALS.get(device)
    if counts is None or counts.numel() < rows:
        counts = torch.zeros(max(rows, 1024), dtype=torch.int32, device=device)
        _ARRIVALS[device] = counts
    return counts


def _argmax_rows(logits: torch.Tensor, keys: torch.Tensor | None) -> torch.Tensor:
    n_rows, vocab = logits.shape
    out = torch.empty(n_rows, dtype=torch.int64, device=logits.device)
    if n_rows:
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        chunks = triton.cdiv(vocab, BLOCK)
        best = torch.empty((n_rows, chunks), dtype=torch.float32, device=logits.device)
        col = torch.empty((n_rows, chunks), dtype=torch.int32, device=logits.device)
        _argmax_kernel[(n_rows, chunks)](
            logits, logits.stride(0), keys if keys is not None else out, best, col,
            _arrivals(n_rows, logits.device), out, vocab,
            NOISE=keys is not None, BLOCK=BLOCK, CHUNKS=max(16, triton.next_power_of_2(chunks)),
            num_warps=8,
        )  # fmt: skip
    return out


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] float on a CUDA device -> [N] int64: each row's argmax (the lowest column
    among equal maxima, as torch.argmax)."""
    return _argmax_rows(logits, None)


def race_sample(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """logits [N, V] float (masked entries -inf), keys [N] int64 on the same CUDA device -> sampled
    ids [N] int64.

    Token t of row i wins with probability softmax(logits[i])[t]; the noise of row i is a function
    of keys[i] only.
    """
    return _argmax_rows(logits, keys)
