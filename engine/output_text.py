"""Text for the outputs of an engine without its tokenizer (EngineArgs.skip_tokenizer_init), made by
the caller that holds it: each sequence's new token ids detokenized, cut at the request's stop
strings (the sequence ends there, as the engine ends it when it detokenizes), and logprobs' tokens
decoded. The outputs equal the detokenizing engine's, by its own rules (engine/core.py). No torch.
"""

from __future__ import annotations

import dataclasses

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer


def engine_params(params: SamplingParams | None) -> SamplingParams | None:
    """What the engine without a tokenizer is asked for: the same, but the stop strings, which
    OutputText applies."""
    if params is None or not params.stop:
        return params
    return dataclasses.replace(params, stop=None)


class OutputText:
    """One request's outputs, from the engine's (token ids only) to the caller's (with text):
    `process(out)` for each cumulative output, in order."""

    def __init__(
        self, tokenizer: Tokenizer, params: SamplingParams | None, eos_token_ids: set[int]
    ):
        self.tokenizer = tokenizer
        self.params = params or SamplingParams()
        self.eos_token_ids = eos_token_ids
        self._seqs: dict[int, _SequenceText] = {}
        self._prompt_decoded = 0

    def process(self, out: RequestOutput) -> RequestOutput:
        outputs = []
        for c in out.outputs:
            seq = self._seqs.get(c.index)
            if seq is None:
                seq = self._seqs[c.index] = _SequenceText(self, c.index)
            outputs.append(seq.update(c))
        plp = out.prompt_logprobs
        if plp is not None:
            decode_logprobs(self.tokenizer, plp[self._prompt_decoded :])
            self._prompt_decoded = len(plp)
        return dataclasses.replace(
            out, outputs=outputs, finished=all(o.finish_reason is not None for o in outputs)
        )


def decode_logprobs(tokenizer: Tokenizer, positions: list[PositionLogprobs | None]) -> None:
    """Each candidate's decoded_token, as the detokenizing engine sets it."""
    for pos in positions:
        for token_id, lp in (pos or {}).items():
            lp.decoded_token = tokenizer.decode_token(token_id)


class _SequenceText:
    """One sequence's detokenizer and what of the engine's sequence it has read."""

    def __init__(self, request: OutputText, index: int):
        p = request.params
        self.request = request
        self.detok = IncrementalDetokenizer(
            request.tokenizer,
            skip_special_tokens=p.skip_special_tokens,
            stop=p.stop,
            include_stop_str_in_output=p.include_stop_str_in_output,
            min_tokens=p.min_tokens,
        )
        self.read = 0  # the engine's tokens read
        self.stopped: CompletionOutput | None = None  # ended here by a stop string: final

    def update(self, c: CompletionOutput) -> CompletionOutput:
        if self.stopped is not None:
            return self.stopped  # the engine ran on until it heard; what it made after is not kept
        request, p = self.request, self.request.params
        if c.logprobs is not None:
            decode_logprobs(request.tokenizer, c.logprobs[self.read :])
        for k in range(self.read, len(c.token_ids)):
            token = c.token_ids[k]
            ends = token in request.eos_token_ids and not p.ignore_eos
            # the end-of-sequence token that ends the output is not part of its text (engine.core)
            if not (ends and not p.include_stop_str_in_output):
                self.detok.add(token)
            if self.detok.stop_reason is not None:  # before the engine's own reasons, as there
                logprobs = c.logprobs[: k + 1] if c.logprobs is not None else None
                cumulative = None
                if logprobs is not None:
                    cumulative = 0.0
                    for t, pos in zip(c.token_ids[: k + 1], logprobs):
                        cumulative += pos[t].logprob
                self.stopped = CompletionOutput(
                    index=c.index,
                    text=self.detok.output_text(True),
                    token_ids=c.token_ids[: k + 1],
                    cumulative_logprob=cumulative,
                    logprobs=logprobs,
                    finish_reason="stop",
                    stop_reason=self.detok.stop_reason,
                )
                return self.stopped
        self.read = len(c.token_ids)
        return dataclasses.replace(c, text=self.detok.output_text(c.finish_reason is not None))
