"""The random draw of the CUDA sampler: per row, argmax of logits + Gumbel noise from a
counter-based RNG (Philox).

Each row's noise depends only on its own 64-bit key, so a seeded request draws the same tokens
whatever the batch.
"""

from __future__ import annotations

import torch

try:  # a CPU-only install may have no triton; the CPU sampler never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None

_MASK64 = (1 << 64) - 1


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
    def _race_kernel(logits_ptr, stride_row, keys_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        key = tl.load(keys_ptr + row)
        lanes = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_col = tl.zeros([BLOCK], tl.int32)
        for start in range(0, vocab, BLOCK):
            cols = start + lanes
            mask = cols < vocab
            logit = tl.load(
                logits_ptr + row * stride_row + cols, mask=mask, other=float("-inf")
            ).to(tl.float32)
            u = tl.rand(key, cols)
            # keep log(-log(u)) finite at both ends
            u = tl.minimum(tl.maximum(u, 1.0e-30), 0.99999994)
            score = logit - tl.log(-tl.log(u))  # Gumbel-max: a draw from softmax(logit)
            better = score > best
            best = tl.where(better, score, best)
            best_col = tl.where(better, cols, best_col)
        winner = tl.argmax(best, axis=0)
        token = tl.sum(tl.where(lanes == winner, best_col, 0), axis=0)
        tl.store(out_ptr + row, token.to(tl.int64))


def race_sample(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """logits [N, V] float (masked entries -inf), keys [N] int64 on the same CUDA device -> sampled
    ids [N] int64.

    Token t of row i wins with probability softmax(logits[i])[t]; the noise of row i is a function
    of keys[i] only.
    """
    n_rows, vocab = logits.shape
    out = torch.empty(n_rows, dtype=torch.int64, device=logits.device)
    if n_rows:
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        _race_kernel[(n_rows,)](logits, logits.stride(0), keys, out, vocab, BLOCK=2048, num_warps=8)
    return out
