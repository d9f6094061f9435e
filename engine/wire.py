"""The engine's requests and outputs as JSON-able dicts, for an engine in another process: sampling
parameters both ways, and a request's cumulative outputs sent as deltas (what is new since the last
one) and put back together on the other side. No torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.outputs import (
    CompletionOutput,
    EngineStats,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from engine.sampling_params import SamplingParams
from engine.structured_outputs import StructuredOutputs


def params_to_wire(params: SamplingParams | None) -> dict | None:
    if params is None:
        return None
    out = dataclasses.asdict(params)  # the grammar's spec, a dataclass too, as a dict
    if params.logit_bias is not None:  # JSON's keys are strings: pairs keep the token ids ints
        out["logit_bias"] = [[int(k), v] for k, v in params.logit_bias.items()]
    return out


def params_from_wire(data: dict | None) -> SamplingParams | None:
    if data is None:
        return None
    data = dict(data)
    if data.get("structured_outputs") is not None:
        data["structured_outputs"] = StructuredOutputs(**data["structured_outputs"])
    if data.get("logit_bias") is not None:
        data["logit_bias"] = {int(k): v for k, v in data["logit_bias"]}
    return SamplingParams(**data)


def stats_to_wire(stats: EngineStats) -> dict:
    return dataclasses.asdict(stats)


def stats_from_wire(data: dict) -> EngineStats:
    return EngineStats(**data)


def _positions_to_wire(positions: list[PositionLogprobs | None]) -> list:
    return [
        None
        if pos is None
        else [[tid, lp.logprob, lp.rank, lp.decoded_token] for tid, lp in pos.items()]
        for pos in positions
    ]


def _positions_from_wire(data: list) -> list[PositionLogprobs | None]:
    return [
        None if pos is None else {tid: Logprob(lp, rank, text) for tid, lp, rank, text in pos}
        for pos in data
    ]


class OutputDeltas:
    """The engine's side of one request: each cumulative RequestOutput -> a dict of what changed
    since the last one it sent."""

    def __init__(self) -> None:
        self._sent: dict[int, tuple[str, int, int]] = {}  # index -> (text, ids, logprobs) sent
        self._first = True
        self._prompt_logprobs = 0  # positions sent (a chunked prompt adds them step by step)

    def delta(self, out: RequestOutput) -> dict:
        seqs = []
        for c in out.outputs:
            text, n_ids, n_lps = self._sent.get(c.index, ("", 0, 0))
            at = len(text) if c.text.startswith(text) else 0  # the text only grows, normally
            lps = c.logprobs
            seqs.append(
                {
                    "index": c.index,
                    "text_at": at,
                    "text": c.text[at:],
                    "token_ids": c.token_ids[n_ids:],
                    "logprobs": None if lps is None else _positions_to_wire(lps[n_lps:]),
                    "cumulative_logprob": c.cumulative_logprob,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
            self._sent[c.index] = (c.text, len(c.token_ids), len(lps) if lps is not None else 0)
        msg: dict[str, Any] = {
            "outputs": seqs,
            "finished": out.finished,
            "metrics": dataclasses.asdict(out.metrics) if out.metrics is not None else None,
            "num_cached_tokens": out.num_cached_tokens,
        }
        if self._first:  # the prompt and its ids do not change
            self._first = False
            msg["prompt"] = out.prompt
            msg["prompt_token_ids"] = out.prompt_token_ids
        plp = out.prompt_logprobs
        if plp is not None:
            msg["prompt_logprobs"] = _positions_to_wire(plp[self._prompt_logprobs :])
            self._prompt_logprobs = len(plp)
        return msg


class OutputAssembly:
    """The caller's side of one request: each delta -> the cumulative RequestOutput the engine
    had (a new object each time, as the engine's own outputs are)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._prompt: tuple = (None, [])
        self._prompt_logprobs: list[PositionLogprobs | None] | None = None
        self._seqs: dict[int, CompletionOutput] = {}

    def apply(self, delta: dict) -> RequestOutput:
        if "prompt_token_ids" in delta:
            self._prompt = (delta["prompt"], delta["prompt_token_ids"])
        if delta.get("prompt_logprobs") is not None:
            self._prompt_logprobs = (self._prompt_logprobs or []) + _positions_from_wire(
                delta["prompt_logprobs"]
            )
        for d in delta["outputs"]:
            before = self._seqs.get(d["index"])
            text = (before.text[: d["text_at"]] if before else "") + d["text"]
            ids = (before.token_ids if before else []) + d["token_ids"]
            lps = None
            if d["logprobs"] is not None:
                lps = ((before.logprobs or []) if before else []) + _positions_from_wire(
                    d["logprobs"]
                )
            self._seqs[d["index"]] = CompletionOutput(
                index=d["index"],
                text=text,
                token_ids=ids,
                cumulative_logprob=d["cumulative_logprob"],
                logprobs=lps,
                finish_reason=d["finish_reason"],
                stop_reason=d["stop_reason"],
            )
        metrics = delta["metrics"]
        prompt, prompt_ids = self._prompt
        plp = self._prompt_logprobs
        return RequestOutput(
            request_id=self.request_id,
            prompt=prompt,
            prompt_token_ids=prompt_ids,
            prompt_logprobs=list(plp) if plp is not None else None,
            outputs=[self._seqs[d["index"]] for d in delta["outputs"]],
            finished=delta["finished"],
            metrics=RequestMetrics(**metrics) if metrics is not None else None,
            num_cached_tokens=delta["num_cached_tokens"],
        )
