"""/v1/completions: completions written whole or as a stream of chunks, prompts echoed when asked,
with OpenAI's completion logprobs (handler.routes parses the request and starts the engine's
streams).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from handler.request_streams import drain
from handler.serving_base import (
    Answer,
    ChoiceState,
    Serving,
    logprob_value,
    prompt_logprobs_entries,
    stream_usage,
    top_candidates,
)


class CompletionServing(Serving):
    """Completions: whole or streamed (text_completion)."""

    async def full(self, answer: Answer, echo: list[str] | None) -> dict:
        """The whole completion (text_completion); `echo`: each prompt's text, sent before its
        choices' text."""
        streams, prompt_lens = answer.streams, answer.prompt_lens
        req, top_n = answer.request.parsed, answer.request.top_n
        first_token = await drain(streams)
        choices = []
        for i in range(len(prompt_lens)):
            for c in streams.latest[i].outputs:
                prefix = echo[i] if echo else ""
                choices.append(
                    {
                        "index": i * req.n + c.index,
                        "text": prefix + c.text,
                        "logprobs": self.logprobs(c.token_ids, c.logprobs or [], top_n, len(prefix))
                        if req.logprobs is not None
                        else None,
                        "finish_reason": c.finish_reason,
                    }
                )
                if req.prompt_logprobs is not None:
                    choices[-1]["prompt_logprobs"] = prompt_logprobs_entries(
                        streams.latest[i].prompt_logprobs
                    )
        usage = self.finish(answer, first_token)
        return {**answer.head, "object": "text_completion", "choices": choices, "usage": usage}

    async def stream(self, answer: Answer, echo: list[str] | None) -> AsyncIterator[dict]:
        """The completion as chunks (text_completion; the echoed prompts first), then usage when
        asked."""
        streams, prompt_lens = answer.streams, answer.prompt_lens
        req, top_n = answer.request.parsed, answer.request.top_n
        head = {**answer.head, "object": "text_completion"}
        include_usage, continuous = stream_usage(req)
        states = {(i, j): ChoiceState() for i in range(len(prompt_lens)) for j in range(req.n)}
        first_token = None
        try:
            if echo:
                first = [
                    {
                        "index": i * req.n + j,
                        "text": echo[i],
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for i in range(len(prompt_lens))
                    for j in range(req.n)
                ]
                yield {**head, "choices": first, **({"usage": None} if include_usage else {})}
            async for latest in streams.updates():
                choices = []
                for i, out in sorted(latest.items()):
                    for c in out.outputs:
                        st = states[(i, c.index)]
                        sent = st.advance(c)
                        if sent is None:
                            continue
                        delta_text, new_ids, tokens_before, text_before = sent
                        offset = (len(echo[i]) if echo else 0) + text_before
                        choice = {
                            "index": i * req.n + c.index,
                            "text": delta_text,
                            "logprobs": None,
                            "finish_reason": c.finish_reason,
                        }
                        if req.logprobs is not None and new_ids:
                            choice["logprobs"] = self.logprobs(
                                new_ids, (c.logprobs or [])[tokens_before:], top_n, offset
                            )
                        if delta_text or st.finished or choice["logprobs"]:
                            choices.append(choice)
                if first_token is None and any(st.tokens for st in states.values()):
                    first_token = time.monotonic()
                if choices:
                    c = {**head, "choices": choices}
                    if include_usage:
                        c["usage"] = self.usage(prompt_lens, latest) if continuous else None
                    yield c
            usage = self.finish(answer, first_token)
            if include_usage:
                yield {**head, "choices": [], "usage": usage}
        finally:
            await streams.close()

    def logprobs(self, token_ids: list[int], positions: list, top_n: int, offset: int) -> dict:
        out: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for token_id, pos in zip(token_ids, positions):
            text = self.token_text(pos, token_id)
            chosen = pos.get(token_id) if pos else None
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob_value(chosen.logprob) if chosen else None)
            out["top_logprobs"].append(
                {
                    self.token_text(pos, tid): logprob_value(lp.logprob)
                    for tid, lp in top_candidates(pos, top_n)
                }
            )
            out["text_offset"].append(offset)
            offset += len(text)
        return out
