"""/v1/chat/completions: a chat reply written whole or as a stream of chunks, with OpenAI's chat
logprobs (handler.routes parses the request and starts the engine's streams).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from handler.chat_reply import (
    ReplyDelta,
    ReplyReader,
    delta_fields,
    stream_finish_reason,
    whole_reply,
)
from handler.request_streams import drain
from handler.serving_base import (
    MIN_LOGPROB,
    Answer,
    ChoiceState,
    Serving,
    logprob_value,
    prompt_logprobs_entries,
    stream_usage,
    top_candidates,
)


class ChatServing(Serving):
    """Chat answers: whole (chat.completion) or streamed (chat.completion.chunk)."""

    async def full(self, answer: Answer) -> dict:
        """The whole reply (chat.completion)."""
        streams, request = answer.streams, answer.request
        req, top_n = request.parsed, request.top_n
        first_token = await drain(streams)
        out = streams.latest[0]
        choices = []
        role = self.settings.openai_response_role
        for c in out.outputs:
            message, finish_reason = whole_reply(request.reply, c.text, role, c.finish_reason)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": {"content": self.logprobs(c.token_ids, c.logprobs or [], top_n)}
                    if req.logprobs
                    else None,
                    "finish_reason": finish_reason,
                }
            )
        usage = self.finish(answer, first_token)
        response = {**answer.head, "object": "chat.completion", "choices": choices, "usage": usage}
        if req.prompt_logprobs is not None:
            response["prompt_logprobs"] = prompt_logprobs_entries(out.prompt_logprobs)
        return response

    async def stream(self, answer: Answer) -> AsyncIterator[dict]:
        """The reply as chunks (chat.completion.chunk), then usage when asked."""
        streams, request, prompt_lens = answer.streams, answer.request, answer.prompt_lens
        req, top_n = request.parsed, request.top_n
        head = {**answer.head, "object": "chat.completion.chunk"}
        include_usage, continuous = stream_usage(req)
        states = [ChoiceState() for _ in range(req.n)]
        readers = [ReplyReader(request.reply) for _ in range(req.n)]
        role = self.settings.openai_response_role
        first_token = None

        def chunk(choices: list[dict], latest) -> dict:
            c = {**head, "choices": choices}
            if include_usage:
                c["usage"] = self.usage(prompt_lens, latest) if continuous else None
            return c

        try:
            yield chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": role, "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for i in range(req.n)
                ],
                streams.latest,
            )
            async for latest in streams.updates():
                choices = []
                for c in latest[0].outputs:
                    st = states[c.index]
                    sent = st.advance(c)
                    if sent is None:
                        continue
                    delta_text, new_ids, tokens_before, _ = sent
                    reader = readers[c.index]
                    delta = reader.feed(delta_text)
                    if st.finished:
                        delta = joined(delta, reader.finish())
                    choice: dict[str, Any] = {
                        "index": c.index,
                        "delta": delta_fields(reader, delta),
                        "logprobs": None,
                        "finish_reason": stream_finish_reason(reader, c.finish_reason),
                    }
                    if req.logprobs and new_ids:
                        choice["logprobs"] = {
                            "content": self.logprobs(
                                new_ids, (c.logprobs or [])[tokens_before:], top_n
                            )
                        }
                    if choice["delta"] or st.finished or choice["logprobs"]:
                        choices.append(choice)
                if first_token is None and any(st.tokens for st in states):
                    first_token = time.monotonic()
                if choices:
                    yield chunk(choices, latest)
            usage = self.finish(answer, first_token)
            if include_usage:
                yield {**head, "choices": [], "usage": usage}
        finally:
            await streams.close()

    def logprobs(self, token_ids: list[int], positions: list, top_n: int) -> list[dict]:
        content = []
        for token_id, pos in zip(token_ids, positions):
            text = self.token_text(pos, token_id)
            chosen = pos.get(token_id) if pos else None
            content.append(
                {
                    "token": text,
                    "logprob": logprob_value(chosen.logprob) if chosen else MIN_LOGPROB,
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [
                        {
                            "token": (t := self.token_text(pos, tid)),
                            "logprob": logprob_value(lp.logprob),
                            "bytes": list(t.encode("utf-8")),
                        }
                        for tid, lp in top_candidates(pos, top_n)
                    ],
                }
            )
        return content


def joined(a: ReplyDelta, b: ReplyDelta) -> ReplyDelta:
    return ReplyDelta(a.reasoning + b.reasoning, a.content + b.content, a.tool_calls + b.tool_calls)
