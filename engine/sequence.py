"""Request and sequence state: the token lists, the KV block table and the progress counters the
scheduler reads.

A Request holds n Sequences (one per sample); each Sequence is scheduled, preempted and finished on
its own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.outputs import PositionLogprobs, RequestMetrics
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.detokenizer import IncrementalDetokenizer
    from engine.structured import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request: "Request"
    index: int  # which of the request's n samples
    token_ids: list[int]  # prompt followed by the generated tokens
    num_prompt_tokens: int
    max_total_tokens: int  # the context limit for this sequence (prompt + output)
    generator: torch.Generator | None = None
    detokenizer: "IncrementalDetokenizer | None" = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    # Sampled tokens whose ids are still on the device (async scheduling): they count in num_tokens,
    # so the next step is scheduled as if they were known, but they are not in token_ids yet.
    num_pending: int = 0
    block_table: list[int] = field(default_factory=list)
    # chained hashes of the full blocks of token_ids
    block_hashes: list[bytes] = field(default_factory=list)
    num_hashed_blocks: int = 0  # how many of block_table are published in the prefix cache
    parent: "Sequence | None" = None  # sample 0, whose prompt blocks the other samples share
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    grammar: "GrammarMatcher | None" = (
        None  # structured outputs: where the output is in its grammar
    )

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def arrival(self) -> int:
        return self.request.arrival_order

    @property
    def num_tokens(self) -> int:
        """Known tokens plus the pending ones: what the scheduler and the KV cache count."""
        return len(self.token_ids) + self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens known on the host (a new list)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, pending ones included: the index of the next token to sample."""
        return len(self.token_ids) + self.num_pending - self.num_prompt_tokens

    def at_length_limit(self, num_tokens: int) -> bool:
        """The length rule: with `num_tokens` tokens (prompt included) the sequence has reached
        max_tokens or the context limit, and finishes with "length"."""
        max_tokens = self.request.params.max_tokens
        return num_tokens >= self.max_total_tokens or (
            max_tokens is not None and num_tokens - self.num_prompt_tokens >= max_tokens
        )

    @property
    def reaches_length_limit(self) -> bool:
        """Its tokens (pending ones included) already reach the length limit: once they are known
        it finishes with "length", so there is nothing more to schedule for it."""
        return self.at_length_limit(len(self.token_ids) + self.num_pending)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.index == 0 and self.params.prompt_logprobs is not None

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop the cached state, keep the tokens; the next admission
        prefills them all."""
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table = []
        self.num_hashed_blocks = 0
        self.num_preemptions += 1


@dataclass(eq=False)
class Request:
    request_id: str
    arrival_order: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    # Filled for positions 1..len(prompt)-1 as the prompt is computed; position 0 has none.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # prompt tokens found in the KV cache at first admission (prefix cache, or sample 0)
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        for s in self.seqs:
            if s.status is not SequenceStatus.FINISHED:
                return False
        return True
