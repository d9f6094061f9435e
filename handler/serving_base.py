"""What the chat and the completions serving share (handler.serving_chat,
handler.serving_completion): the answer they write from, what each streamed choice has sent, usage
and its metrics, and the logprob values and token texts both formats carry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from handler.config import Settings
from handler.engine_requests import EngineRequest
from handler.metrics import Metrics
from handler.request_streams import RequestStreams

# JSON has no infinity: a logprob of -inf is sent as this (as vLLM does).
MIN_LOGPROB = -9999.0


def logprob_value(value: float) -> float:
    return max(value, MIN_LOGPROB)


@dataclass
class Answer:
    """What one chat or completions answer is written from: the engine's streams for it, the
    response's head (id, created, model), the engine request it serves, and when it arrived."""

    streams: RequestStreams
    head: dict
    request: EngineRequest
    t0: float

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.request.prompts]


class ChoiceState:
    """What one streamed choice has sent so far."""

    __slots__ = ("text_len", "tokens", "finished")

    def __init__(self) -> None:
        self.text_len = 0
        self.tokens = 0
        self.finished = False

    def advance(self, c) -> tuple[str, list[int], int, int] | None:
        """What choice `c` (its cumulative output) adds since the last chunk, recorded as sent: (new
        text, new token ids, tokens sent before, text length sent before); None when there is
        nothing new to send."""
        if self.finished:
            return None
        delta_text = c.text[self.text_len :]
        new_ids = c.token_ids[self.tokens :]
        if not delta_text and not new_ids and c.finish_reason is None:
            return None
        tokens_before, text_before = self.tokens, self.text_len
        self.text_len, self.tokens = len(c.text), len(c.token_ids)
        self.finished = c.finish_reason is not None
        return delta_text, new_ids, tokens_before, text_before


class Serving:
    """Usage, its metrics and token texts, for the chat and the completions serving."""

    def __init__(self, tokenizer, settings: Settings, metrics: Metrics | None):
        self.tokenizer = tokenizer
        self.settings = settings
        self.metrics = metrics

    def usage(self, prompt_lens: list[int], latest: dict[int, Any]) -> dict:
        prompt = sum(prompt_lens)
        completion = sum(len(c.token_ids) for out in latest.values() for c in out.outputs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def record(self, t0: float, first_token: float | None, usage: dict) -> None:
        if self.metrics is None:
            return
        self.metrics.record_tokens(usage["prompt_tokens"], usage["completion_tokens"])
        if first_token is not None:
            self.metrics.observe_ttft(first_token - t0)
        self.metrics.observe_latency(time.monotonic() - t0)

    def finish(self, answer: Answer, first_token: float | None) -> dict:
        """The answer's usage once its streams have ended, recorded in the metrics."""
        usage = self.usage(answer.prompt_lens, answer.streams.latest)
        self.record(answer.t0, first_token, usage)
        return usage

    def token_text(self, position, token_id: int) -> str:
        lp = position.get(token_id) if position else None
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode_token(token_id)


def top_candidates(position, top_n: int) -> list[tuple[int, Any]]:
    """A position's candidates of rank <= top_n, by rank (at most top_n)."""
    top = sorted(
        ((tid, lp) for tid, lp in (position or {}).items() if lp.rank <= top_n),
        key=lambda t: t[1].rank,
    )
    return top[:top_n]


def stream_usage(req) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of a request's stream_options."""
    include = bool(req.stream_options and req.stream_options.include_usage)
    return include, bool(include and req.stream_options.continuous_usage_stats)


def prompt_logprobs_entries(positions: list | None) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: {"logprob",
    "rank", "decoded_token"}} (the prompt's own token and the top candidates)."""
    return [
        None
        if pos is None
        else {
            str(tid): {
                "logprob": logprob_value(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for tid, lp in pos.items()
        }
        for pos in positions or []
    ]
