"""Sampling: the batched Sampler that turns logits into tokens, applying each row's SamplingParams.

Penalties, temperature, top-k/top-p/min-p and the random draw all run on the logits' device,
vectorised over rows; a step reads back one tensor (token ids with any requested logprobs). The
parameters themselves (torch-free) are in engine.sampling_params.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine import step_transfer
from engine.layers.fused import fused_kernels_available
from engine.layers.vocab_argmax import draw_key, greedy_argmax, race_sample
from engine.outputs import Logprob, PositionLogprobs
from engine.sampling_params import SamplingParams
from engine.token_bitmask import apply_token_bitmask

# Temperatures below this are raised to it before dividing, so logits / T never overflows to inf.
_MIN_TEMPERATURE = 1e-5
# A small step's sampled ids (engine.step_transfer.SMALL_STEP rows at most) go to the host on a
# stream of their own, so the next step's kernels need not wait behind the copy (a loaded engine
# keeps one stream: its host has no time to spare for the second); benchmarks turn it off.
COPY_ON_SIDE_STREAM = True
_copy_streams: dict[torch.device, torch.cuda.Stream] = {}


@dataclass
class SamplingRow:
    """One sequence's view for one sampling step; the caller fills it from the sequence's state."""

    params: SamplingParams
    generator: torch.Generator | None  # when set, this row's random draw uses only it
    # or an int64 numpy array, which skips a per-step conversion of a long prompt
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # masked to -inf this step (e.g. EOS under min_tokens)
    banned_token_ids: list[int] = field(default_factory=list)
    # structured outputs: the sequence's engine.structured.GrammarMatcher (its row of the bitmask)
    grammar: Any = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: top-k (params.logprobs) plus the sampled token, from the raw model distribution; None
    # when not asked.
    logprobs: list[PositionLogprobs | None]


# --------------------------------------------------------------------------------------------------
# The transformations. Each works on a float32 [N, V] tensor in place and returns it; per-row values
# come as Python sequences so deciding which rows need work never reads the device.
# --------------------------------------------------------------------------------------------------


def apply_banned_tokens(
    logits: torch.Tensor, banned_token_ids: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Set logits[i, t] = -inf for every t in banned_token_ids[i] (ids outside the vocabulary are
    ignored)."""
    vocab = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    for i, ids in enumerate(banned_token_ids):
        for t in ids:
            if 0 <= t < vocab:
                rows.append(i)
                cols.append(t)
    if rows:
        index = torch.tensor([rows, cols], dtype=torch.long).to(logits.device, non_blocking=True)
        logits[index[0], index[1]] = float("-inf")
    return logits


def apply_logit_bias(
    logits: torch.Tensor, biases: Sequence[dict[int, float] | None]
) -> torch.Tensor:
    """logits[i, t] += biases[i][t] for each row's bias (ids outside the vocabulary are ignored)."""
    vocab = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, bias in enumerate(biases):
        for t, v in (bias or {}).items():
            if 0 <= t < vocab:
                rows.append(i)
                cols.append(t)
                values.append(v)
    if rows:
        index = torch.tensor([rows, cols], dtype=torch.long).to(logits.device, non_blocking=True)
        add = torch.tensor(values, dtype=logits.dtype).to(logits.device, non_blocking=True)
        logits.index_put_((index[0], index[1]), add, accumulate=True)
    return logits


def _token_counts(
    seqs: Sequence[Sequence[Sequence[int]]], vocab: int, device: torch.device
) -> torch.Tensor:
    """[len(seqs), vocab] float32 counts of the token ids in each row's lists (ids >= vocab are
    dropped)."""
    counts = torch.zeros(len(seqs), vocab + 1, dtype=torch.float32, device=device)
    # numpy builds the flat id array several times faster than torch.tensor(list) does; an int64
    # array passed in (a prompt the caller keeps converted) costs nothing here.
    parts = [np.asarray(ids, dtype=np.int64) for lists in seqs for ids in lists]
    lengths = [sum(len(ids) for ids in lists) for lists in seqs]
    total = sum(lengths)
    if total:
        flat = torch.from_numpy(np.concatenate(parts)).to(device, non_blocking=True)
        row = torch.repeat_interleave(
            torch.arange(len(seqs), device=device),
            torch.tensor(lengths).to(device, non_blocking=True),
            output_size=total,
        )
        flat_index = row * (vocab + 1) + flat.clamp(max=vocab)
        counts.view(-1).scatter_add_(
            0, flat_index, torch.ones(total, dtype=torch.float32, device=device)
        )
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalty: Sequence[float],
    presence_penalty: Sequence[float],
    frequency_penalty: Sequence[float],
) -> torch.Tensor:
    """Repetition penalty over prompt+output tokens (a positive logit is divided by p, any other
    multiplied), then presence/frequency penalties over output tokens only
    (logit -= frequency * count + presence * [count > 0])."""
    vocab, device = logits.shape[-1], logits.device

    rep_rows = [i for i, p in enumerate(repetition_penalty) if p != 1.0]
    if rep_rows:
        seen = (
            _token_counts(
                [(prompt_token_ids[i], output_token_ids[i]) for i in rep_rows], vocab, device
            )
            > 0
        )
        index = torch.tensor(rep_rows).to(device, non_blocking=True)
        penalty = torch.tensor([repetition_penalty[i] for i in rep_rows]).to(
            device, non_blocking=True
        )[:, None]
        sub = logits[index]
        penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits[index] = torch.where(seen, penalised, sub)

    pf_rows = [
        i
        for i in range(len(presence_penalty))
        if presence_penalty[i] != 0 or frequency_penalty[i] != 0
    ]
    if pf_rows:
        counts = _token_counts([(output_token_ids[i],) for i in pf_rows], vocab, device)
        index = torch.tensor(pf_rows).to(device, non_blocking=True)
        pres = torch.tensor([presence_penalty[i] for i in pf_rows]).to(device, non_blocking=True)[
            :, None
        ]
        freq = torch.tensor([frequency_penalty[i] for i in pf_rows]).to(device, non_blocking=True)[
            :, None
        ]
        logits[index] -= freq * counts + pres * (counts > 0).float()
    return logits


def apply_temperature(logits: torch.Tensor, temperature: Sequence[float]) -> torch.Tensor:
    """Divide each row by its temperature (raised to a tiny floor so the result stays finite)."""
    if any(t != 1.0 for t in temperature):
        temps = torch.tensor([max(t, _MIN_TEMPERATURE) for t in temperature], dtype=logits.dtype)
        logits.div_(temps.to(logits.device, non_blocking=True)[:, None])
    return logits


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: Sequence[int] | None = None,
    top_p: Sequence[float] | None = None,
    min_p: Sequence[float] | None = None,
) -> torch.Tensor:
    """Mask to -inf, in this order: tokens below the k-th largest logit (ties with it stay; k <= 0
    disables), then the tail outside the smallest set of most likely tokens whose mass reaches top_p
    (the top token always stays), then tokens whose probability is below min_p times the largest
    probability."""
    vocab, device = logits.shape[-1], logits.device
    use_k = top_k is not None and any(0 < k < vocab for k in top_k)
    use_p = top_p is not None and any(p < 1.0 for p in top_p)
    use_min_p = min_p is not None and any(p > 0.0 for p in min_p)

    if use_k and not use_p:
        # top-k alone: the k-th largest value comes from topk, much cheaper than sorting the whole
        # vocabulary.
        enabled = [0 < k < vocab for k in top_k]
        kmax = max(k for k, on in zip(top_k, enabled) if on)
        top_vals = logits.topk(kmax, dim=-1).values
        index = torch.tensor([k - 1 if on else 0 for k, on in zip(top_k, enabled)]).to(
            device, non_blocking=True
        )
        kth = top_vals.gather(1, index[:, None])
        on = torch.tensor(enabled).to(device, non_blocking=True)[:, None]
        logits.masked_fill_((logits < kth) & on, float("-inf"))
    elif use_k or use_p:
        # Ascending order: the tail mass below a token is then summed smallest-first, the accurate
        # way round.
        sorted_logits, order = logits.sort(dim=-1)
        if use_k:
            index = torch.tensor([vocab - k if 0 < k < vocab else 0 for k in top_k]).to(
                device, non_blocking=True
            )
            kth = sorted_logits.gather(1, index[:, None])
            sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
        if use_p:
            # A token goes when it and every less likely token together hold at most 1 - top_p of
            # the mass.
            tail_limit = torch.tensor([1.0 - p for p in top_p], dtype=torch.float32).to(
                device, non_blocking=True
            )
            tail_mass = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop = (tail_mass <= tail_limit[:, None]) & (tail_limit[:, None] > 0)
            drop[:, -1] = False  # the most likely token always stays
            sorted_logits.masked_fill_(drop, float("-inf"))
        logits.scatter_(1, order, sorted_logits)

    if use_min_p:
        mp = torch.tensor(min_p, dtype=torch.float32).to(device, non_blocking=True)[:, None]
        probs = logits.softmax(dim=-1)
        logits.masked_fill_(probs < mp * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return logits


def random_sample(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """argmax(probs / q) with q ~ Exponential(1): a draw from each row's distribution.

    A row with a generator draws its q from that generator alone, so its token never depends on the
    other rows; rows without one share a single draw from torch's default RNG.
    """
    q = torch.empty_like(probs)
    default_rows = [i for i, g in enumerate(generators) if g is None]
    if len(default_rows) == len(generators):
        q.exponential_()
    else:
        for i, g in enumerate(generators):
            if g is not None:
                q[i].exponential_(generator=g)
        if default_rows:
            index = torch.tensor(default_rows).to(probs.device, non_blocking=True)
            q[index] = torch.empty(
                len(default_rows), probs.shape[-1], device=probs.device
            ).exponential_()
    # q == 0 would turn a masked token's 0 / 0 into NaN, which argmax would pick.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)


# --------------------------------------------------------------------------------------------------
# Logprobs
# --------------------------------------------------------------------------------------------------


def _logprob_tensors(
    logprobs: torch.Tensor, token_ids: torch.Tensor, kmax: int
) -> list[torch.Tensor]:
    """On the device: the chosen tokens' logprobs [n] and ranks [n] (1 + #strictly greater), and the
    top-kmax ids, logprobs and ranks [n, kmax]; nothing is read back here."""
    chosen = logprobs.gather(1, token_ids[:, None])
    chosen_rank = (logprobs > chosen).sum(dim=-1) + 1
    if kmax <= 0:
        return [token_ids, chosen[:, 0], chosen_rank]
    top_vals, top_ids = logprobs.topk(kmax, dim=-1)
    top_ranks = (top_vals[:, None, :] > top_vals[:, :, None]).sum(dim=-1) + 1
    return [token_ids, chosen[:, 0], chosen_rank, top_ids, top_vals, top_ranks]


def _read_back(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """Every tensor in one device->host transfer (as float64, exact for ids, ranks and float32
    logprobs)."""
    if len(tensors) == 1:
        return [tensors[0].cpu().numpy()]
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).cpu().numpy()
    out, at = [], 0
    for t in tensors:
        out.append(flat[at : at + t.numel()].reshape(t.shape))
        at += t.numel()
    return out


def _logprob_entries(host: list[np.ndarray], ks: Sequence[int]) -> list[PositionLogprobs]:
    """Per row, from _logprob_tensors' arrays read back: the chosen token, then the top ks[i]
    tokens."""
    ints = [a.astype(np.int64).tolist() for a in host[0::3]]  # ids, top ids
    ranks = [a.astype(np.int64).tolist() for a in host[2::3]]  # chosen ranks, top ranks
    ids, chosen, chosen_rank = ints[0], host[1].tolist(), ranks[0]
    has_top = len(host) > 3
    if has_top:
        top_ids, top_vals, top_ranks = ints[1], host[4].tolist(), ranks[1]
    out: list[PositionLogprobs] = []
    for i, k in enumerate(ks):
        entry: PositionLogprobs = {ids[i]: Logprob(chosen[i], chosen_rank[i])}
        for j in range(k if has_top else 0):
            tid = top_ids[i][j]
            if tid not in entry:
                entry[tid] = Logprob(top_vals[i][j], top_ranks[i][j])
        out.append(entry)
    return out


def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: list[int], k: int
) -> list[PositionLogprobs]:
    """For prompt positions: logits [T, V] predict next_token_ids[t]; each entry has that token's
    logprob and rank plus the top-k tokens of the position."""
    if logits.shape[0] != len(next_token_ids):
        raise ValueError(
            f"next_token_ids: expected {logits.shape[0]} ids (one per logits row), "
            f"got {len(next_token_ids)}"
        )
    if logits.shape[0] == 0:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(next_token_ids, dtype=torch.long).to(logits.device, non_blocking=True)
    kmax = min(k, logprobs.shape[-1])
    return _logprob_entries(
        _read_back(_logprob_tensors(logprobs, ids, kmax)), [kmax] * len(next_token_ids)
    )


# --------------------------------------------------------------------------------------------------
# The sampler
# --------------------------------------------------------------------------------------------------


class DeviceSample:
    """One step's sampled token ids, with any requested logprobs, still on the device.

    start_copy() queues their copy to pinned host memory behind the sampling kernels (on a stream of
    its own, which waits for them) and returns at once; result() waits for that copy alone (not for
    later work on the streams) and builds the SamplerOutput.
    """

    def __init__(
        self,
        token_ids: torch.Tensor,
        lp_tensors: list[torch.Tensor],
        lp_rows: list[int],
        ks: list[int],
    ):
        # [N] int64 on the logits' device: the next step's inputs can read them there
        self.token_ids = token_ids
        self._tensors = [token_ids, *lp_tensors]
        self._lp_rows = lp_rows
        self._ks = ks
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def start_copy(self) -> "DeviceSample":
        tensors = self._tensors
        if not tensors[0].is_cuda or self._host is not None:
            return self
        # One transfer: ids alone as int64, or everything as float64 (exact for ids, ranks and
        # float32 logprobs).
        flat = (
            tensors[0]
            if len(tensors) == 1
            else torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
        )
        self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        self._copied = torch.cuda.Event()
        if not COPY_ON_SIDE_STREAM or tensors[0].numel() > step_transfer.SMALL_STEP:
            self._host.copy_(flat, non_blocking=True)
            self._copied.record()
            return self
        stream = _copy_streams.get(flat.device)
        if stream is None:
            stream = _copy_streams[flat.device] = torch.cuda.Stream(flat.device)
        stream.wait_stream(torch.cuda.current_stream(flat.device))
        with torch.cuda.stream(stream):
            self._host.copy_(flat, non_blocking=True)
            self._copied.record(stream)
        flat.record_stream(stream)  # its memory is not reused before the copy has read it
        return self

    def _read_back(self) -> list[np.ndarray]:
        tensors = self._tensors
        if self._host is None:
            return _read_back(tensors)
        self._copied.synchronize()
        flat = self._host.numpy()
        if len(tensors) == 1:
            return [flat]
        out, at = [], 0
        for t in tensors:
            out.append(flat[at : at + t.numel()].reshape(t.shape))
            at += t.numel()
        return out

    def result(self) -> SamplerOutput:
        host = self._read_back()
        ids = host[0].astype(np.int64).tolist()
        logprobs: list[PositionLogprobs | None] = [None] * len(ids)
        if self._lp_rows:
            for i, entry in zip(self._lp_rows, _logprob_entries(host[1:], self._ks)):
                logprobs[i] = entry
        return SamplerOutput(ids, logprobs)


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: on CUDA split over many programs (engine.layers.vocab_argmax), the same
    choice as torch.argmax's."""
    if fused_kernels_available(logits):
        return greedy_argmax(logits)
    return logits.argmax(dim=-1)


class Sampler:
    """Samples one token per row of a [N, V] logits batch, each row under its own SamplingParams.

    Order: logit bias -> the grammar's bitmask -> banned ids -> repetition penalty ->
    presence/frequency penalties -> greedy rows take the argmax -> temperature -> top-k -> top-p ->
    min-p -> exponential-race draw. Logprobs come from the raw logits.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        bitmask: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Sample and read the result back (waits for the device)."""
        return self.sample(logits, rows, bitmask).result()

    def sample(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        bitmask: torch.Tensor | None = None,
        scratch: bool = False,
    ) -> DeviceSample:
        """Sample on the logits' device; nothing is read back (DeviceSample.result() does that).
        bitmask: int32 [rows, ceil(vocab / 32)] on the logits' device, the tokens each row's grammar
        allows (engine.structured); None when no row has one. scratch: the caller is done with the
        logits, so the sampler may edit them in place instead of a copy."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits: expected shape [{len(rows)}, vocab], got {list(logits.shape)}"
            )
        if not rows:
            return DeviceSample(torch.zeros(0, dtype=torch.int64, device=logits.device), [], [], [])
        params = [r.params for r in rows]
        raw = logits.float()
        # raw is read again for logprobs, and may be the caller's tensor: edits go to a copy then
        keep_raw = any(p.logprobs is not None for p in params) or (raw is logits and not scratch)
        edits = bitmask is not None
        for r in rows:
            p = r.params
            if (
                p.logit_bias
                or r.banned_token_ids
                or p.repetition_penalty != 1.0
                or p.presence_penalty != 0
                or p.frequency_penalty != 0
            ):
                edits = True
                break
        work = raw.clone() if edits and keep_raw else raw
        if edits:
            if any(p.logit_bias for p in params):
                apply_logit_bias(work, [p.logit_bias for p in params])
            if bitmask is not None:
                apply_token_bitmask(work, bitmask)
            apply_banned_tokens(work, [r.banned_token_ids for r in rows])
            apply_penalties(
                work,
                [r.prompt_token_ids for r in rows],
                [r.output_token_ids for r in rows],
                [p.repetition_penalty for p in params],
                [p.presence_penalty for p in params],
                [p.frequency_penalty for p in params],
            )

        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        everyone = len(sampled_rows) == len(rows)
        token_ids = None if everyone else _greedy(work)
        if sampled_rows:
            index = (
                None if everyone else torch.tensor(sampled_rows).to(work.device, non_blocking=True)
            )
            if index is not None:
                sub = work[index]
            else:
                sub = raw.clone() if keep_raw and not edits else work
            sp = [params[i] for i in sampled_rows]
            apply_temperature(sub, [p.temperature for p in sp])
            apply_top_k_top_p_min_p(
                sub, [p.top_k for p in sp], [p.top_p for p in sp], [p.min_p for p in sp]
            )
            sampled = self._draw(sub, [rows[i].generator for i in sampled_rows])
            if index is None:
                token_ids = sampled
            else:
                token_ids[index] = sampled

        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not lp_rows:
            return DeviceSample(token_ids, [], [], [])
        index = torch.tensor(lp_rows).to(raw.device, non_blocking=True)
        ks = [params[i].logprobs for i in lp_rows]
        kmax = min(max(ks), raw.shape[-1])
        lp = _logprob_tensors(torch.log_softmax(raw[index], dim=-1), token_ids[index], kmax)
        return DeviceSample(token_ids, lp, lp_rows, [min(k, kmax) for k in ks])

    @staticmethod
    def _draw(logits: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One token per row of processed logits. On CUDA: one Triton kernel keyed per row by its
        generator (or the device's default generator), no sync; elsewhere the exponential race of
        random_sample."""
        if fused_kernels_available(logits) and all(
            g is None or g.device.type == "cuda" for g in generators
        ):
            default = (
                torch.cuda.default_generators[logits.device.index or 0]
                if None in generators
                else None
            )
            keys = [draw_key(default if g is None else g) for g in generators]
            return race_sample(
                logits, torch.tensor(keys, dtype=torch.int64).to(logits.device, non_blocking=True)
            )
        return random_sample(logits.softmax(dim=-1), generators)
