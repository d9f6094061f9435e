"""The OpenAI routes (/v1/models, /v1/chat/completions, /v1/completions), one implementation for
both faces: RunPod jobs (handler.jobs) and the HTTP server (handler.server) call
`OpenAIRoutes.dispatch(route, body)`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from handler import responses_api
from handler.chat_reply import (
    ReplyDelta,
    ReplyReader,
    delta_fields,
    stream_finish_reason,
    whole_reply,
)
from handler.config import Settings
from handler.engine_requests import (
    CHAT_ROUTE,
    DETOKENIZE_ROUTE,
    MODELS_ROUTE,
    RESPONSES_ROUTE,
    ROUTE_METHODS,
    ROUTES,
    TOKENIZE_ROUTE,
    VERSION_ROUTE,
    EngineRequest,
    RequestBuilder,
    canonical_route,
    parse_body,
)
from handler.generation_defaults import generation_defaults
from handler.metrics import Metrics
from handler.output_rules import ToolSettings
from handler.protocol import ApiError
from handler.reasoning import ReasoningParser, detect_reasoning_parser, reasoning_parser
from handler.request_streams import ChunkStream, RequestStreams, drain
from handler.token_routes import TokenRoutes
from handler.tool_parsers import detect_tool_parser, tool_call_parser

log = logging.getLogger(__name__)

# JSON has no infinity: a logprob of -inf is sent as this (as vLLM does).
MIN_LOGPROB = -9999.0


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


class _ChoiceState:
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


class OpenAIRoutes:
    """`await routes.dispatch(route, body)` -> a response dict, or an async iterator of chunk dicts
    when body["stream"] is true. Errors raise ApiError with the HTTP status and the field at
    fault."""

    def __init__(
        self, engine, settings: Settings, served_names: list[str], metrics: Metrics | None = None
    ):
        if not served_names:
            raise ValueError("served_names: at least one model name is needed")
        self.engine = engine
        self.settings = settings
        self.served_names = list(dict.fromkeys(served_names))
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        if self.tokenizer is None:
            raise ValueError("model: the OpenAI routes need a model with a tokenizer")
        core = engine.engine
        self.max_model_len: int = core.max_model_len
        template = self.tokenizer.chat_template
        self.requests = RequestBuilder(
            self.tokenizer,
            core.context_limit,
            core.model_config.vocab_size,
            self.served_names,
            settings.default_max_tokens,
            tool_settings(settings, template),
            reasoning_rules(settings, template),
            generation_defaults(core.args.model) if settings.generation_config == "auto" else {},
        )
        self.created = int(time.time())
        self.tokens = TokenRoutes(self.requests, self.max_model_len)

    # ---- entry point -----------------------------------------------------------------------------
    async def dispatch(
        self, route: str, body: Any, method: str | None = None
    ) -> dict | AsyncIterator[dict]:
        """Serve `body` on `route` ('/v1/...', also '/openai/v1/...'); `method`, when given, must
        be the route's."""
        path = canonical_route(route, "openai_route")
        if path not in ROUTES:
            raise ApiError(
                404,
                f"route {str(route)[:200]!r} does not exist; the routes are "
                f"{', '.join(ROUTES)} (also under /openai/v1/...)",
                "route",
            )
        if method is not None and method != ROUTE_METHODS[path]:
            raise ApiError(
                405,
                f"method: {method[:20]} is not allowed on {path} (it answers "
                f"{ROUTE_METHODS[path]})",
                "method",
            )
        if path == MODELS_ROUTE:
            return self.models()
        if path == VERSION_ROUTE:
            return {"version": coldbrew_version()}
        if path in (TOKENIZE_ROUTE, DETOKENIZE_ROUTE):
            return await self.tokens.answer(path, body)
        if path == RESPONSES_ROUTE:
            return await self._counted(path, self._responses(body))
        return await self._counted(path, self._serve(path, body))

    async def _responses(self, body: Any) -> dict | ChunkStream:
        """/v1/responses: served as the chat completion it stands for."""
        req = responses_api.parse_request(body)
        answer = await self._serve(CHAT_ROUTE, responses_api.chat_body(req))
        if isinstance(answer, ChunkStream):
            model = self.requests.model(req.model)
            return answer.mapped(
                lambda chunks: responses_api.events_from_chunks(req, model, chunks)
            )
        return responses_api.from_chat(req, answer)

    async def _counted(self, route: str, work):
        """Count the request in the metrics; a stream is counted when it ends."""
        m = self.metrics
        if m is not None:
            m.started()
        try:
            result = await work
        except ApiError as e:
            if m is not None:
                m.finished(route, e.status)
            raise
        except asyncio.CancelledError:  # the client left before the answer
            if m is not None:
                m.finished(route, 499)
            raise
        except BaseException:
            if m is not None:
                m.finished(route, 500)
            raise
        if isinstance(result, ChunkStream):
            result.on_end = (lambda status: m.finished(route, status)) if m is not None else None
        elif m is not None:
            m.finished(route, 200)
        return result

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "coldbrew",
                    "max_model_len": self.max_model_len,
                }
                for name in self.served_names
            ],
        }

    async def prepare(self, route: str, body: Any) -> EngineRequest:
        """The engine request a chat or completions body stands for (prompt/messages jobs run it
        themselves)."""
        return await self.requests.build(route, parse_body(route, body))

    async def _serve(self, route: str, body: Any) -> dict | AsyncIterator[dict]:
        t0 = time.monotonic()
        request = await self.prepare(route, body)
        req = request.parsed
        rid = f"{'chatcmpl' if route == CHAT_ROUTE else 'cmpl'}-{uuid.uuid4().hex}"
        streams = await self._start(rid, request)
        head = {"id": rid, "created": int(time.time()), "model": request.model}
        lens = [len(p) for p in request.prompts]
        top_n = request.top_n
        if route == CHAT_ROUTE:
            if req.stream:
                return ChunkStream(self._chat_stream(streams, head, request, lens, t0), streams)
            return await self._chat_full(streams, head, request, lens, t0)
        echo = None
        if req.echo:
            echo = request.texts or [
                self.tokenizer.decode(p, skip_special_tokens=False) for p in request.prompts
            ]
        if req.stream:
            chunks = self._completion_stream(streams, head, req, lens, top_n, echo, t0)
            return ChunkStream(chunks, streams)
        return await self._completion_full(streams, head, req, lens, top_n, echo, t0)

    async def _start(self, request_id: str, request: EngineRequest) -> RequestStreams:
        streams = RequestStreams(self.engine, request_id, request.prompts, request.params)
        try:
            await streams.start()
        except ValueError as e:
            raise request.engine_error(e) from None
        return streams

    def _usage(self, prompt_lens: list[int], latest: dict[int, Any]) -> dict:
        prompt = sum(prompt_lens)
        completion = sum(len(c.token_ids) for out in latest.values() for c in out.outputs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _record(self, t0: float, first_token: float | None, usage: dict) -> None:
        if self.metrics is None:
            return
        self.metrics.record_tokens(usage["prompt_tokens"], usage["completion_tokens"])
        if first_token is not None:
            self.metrics.observe_ttft(first_token - t0)
        self.metrics.observe_latency(time.monotonic() - t0)

    def _token_text(self, position, token_id: int) -> str:
        lp = position.get(token_id) if position else None
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode_token(token_id)

    # ---- logprobs formats ------------------------------------------------------------------------
    def _chat_logprobs(self, token_ids: list[int], positions: list, top_n: int) -> list[dict]:
        content = []
        for token_id, pos in zip(token_ids, positions):
            text = self._token_text(pos, token_id)
            chosen = pos.get(token_id) if pos else None
            top = sorted(
                ((tid, lp) for tid, lp in (pos or {}).items() if lp.rank <= top_n),
                key=lambda t: t[1].rank,
            )
            content.append(
                {
                    "token": text,
                    "logprob": _logprob(chosen.logprob) if chosen else MIN_LOGPROB,
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [
                        {
                            "token": (t := self._token_text(pos, tid)),
                            "logprob": _logprob(lp.logprob),
                            "bytes": list(t.encode("utf-8")),
                        }
                        for tid, lp in top[:top_n]
                    ],
                }
            )
        return content

    def _completion_logprobs(
        self, token_ids: list[int], positions: list, top_n: int, offset: int
    ) -> dict:
        out: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for token_id, pos in zip(token_ids, positions):
            text = self._token_text(pos, token_id)
            chosen = pos.get(token_id) if pos else None
            out["tokens"].append(text)
            out["token_logprobs"].append(_logprob(chosen.logprob) if chosen else None)
            top = sorted(
                ((tid, lp) for tid, lp in (pos or {}).items() if lp.rank <= top_n),
                key=lambda t: t[1].rank,
            )
            out["top_logprobs"].append(
                {self._token_text(pos, tid): _logprob(lp.logprob) for tid, lp in top[:top_n]}
            )
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    # ---- /v1/chat/completions --------------------------------------------------------------------
    async def _chat_full(
        self, streams: RequestStreams, head: dict, request: EngineRequest, prompt_lens, t0
    ) -> dict:
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
                    "logprobs": {
                        "content": self._chat_logprobs(c.token_ids, c.logprobs or [], top_n)
                    }
                    if req.logprobs
                    else None,
                    "finish_reason": finish_reason,
                }
            )
        usage = self._usage(prompt_lens, streams.latest)
        self._record(t0, first_token, usage)
        response = {**head, "object": "chat.completion", "choices": choices, "usage": usage}
        if req.prompt_logprobs is not None:
            response["prompt_logprobs"] = prompt_logprobs_entries(out.prompt_logprobs)
        return response

    async def _chat_stream(
        self, streams: RequestStreams, head: dict, request: EngineRequest, prompt_lens, t0
    ) -> AsyncIterator[dict]:
        req, top_n = request.parsed, request.top_n
        head = {**head, "object": "chat.completion.chunk"}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
        states = [_ChoiceState() for _ in range(req.n)]
        readers = [ReplyReader(request.reply) for _ in range(req.n)]
        role = self.settings.openai_response_role
        first_token = None

        def chunk(choices: list[dict], latest) -> dict:
            c = {**head, "choices": choices}
            if include_usage:
                c["usage"] = self._usage(prompt_lens, latest) if continuous else None
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
                        delta = _joined(delta, reader.finish())
                    choice: dict[str, Any] = {
                        "index": c.index,
                        "delta": delta_fields(reader, delta),
                        "logprobs": None,
                        "finish_reason": stream_finish_reason(reader, c.finish_reason),
                    }
                    if req.logprobs and new_ids:
                        choice["logprobs"] = {
                            "content": self._chat_logprobs(
                                new_ids, (c.logprobs or [])[tokens_before:], top_n
                            )
                        }
                    if choice["delta"] or st.finished or choice["logprobs"]:
                        choices.append(choice)
                if first_token is None and any(st.tokens for st in states):
                    first_token = time.monotonic()
                if choices:
                    yield chunk(choices, latest)
            usage = self._usage(prompt_lens, streams.latest)
            self._record(t0, first_token, usage)
            if include_usage:
                yield {**head, "choices": [], "usage": usage}
        finally:
            await streams.close()

    # ---- /v1/completions -------------------------------------------------------------------------
    async def _completion_full(
        self, streams: RequestStreams, head: dict, req, prompt_lens, top_n, echo, t0
    ) -> dict:
        first_token = await drain(streams)
        choices = []
        for i in range(len(prompt_lens)):
            for c in streams.latest[i].outputs:
                prefix = echo[i] if echo else ""
                choices.append(
                    {
                        "index": i * req.n + c.index,
                        "text": prefix + c.text,
                        "logprobs": self._completion_logprobs(
                            c.token_ids, c.logprobs or [], top_n, len(prefix)
                        )
                        if req.logprobs is not None
                        else None,
                        "finish_reason": c.finish_reason,
                    }
                )
                if req.prompt_logprobs is not None:
                    choices[-1]["prompt_logprobs"] = prompt_logprobs_entries(
                        streams.latest[i].prompt_logprobs
                    )
        usage = self._usage(prompt_lens, streams.latest)
        self._record(t0, first_token, usage)
        return {**head, "object": "text_completion", "choices": choices, "usage": usage}

    async def _completion_stream(
        self, streams: RequestStreams, head: dict, req, prompt_lens, top_n, echo, t0
    ) -> AsyncIterator[dict]:
        head = {**head, "object": "text_completion"}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
        states = {(i, j): _ChoiceState() for i in range(len(prompt_lens)) for j in range(req.n)}
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
                            choice["logprobs"] = self._completion_logprobs(
                                new_ids, (c.logprobs or [])[tokens_before:], top_n, offset
                            )
                        if delta_text or st.finished or choice["logprobs"]:
                            choices.append(choice)
                if first_token is None and any(st.tokens for st in states.values()):
                    first_token = time.monotonic()
                if choices:
                    c = {**head, "choices": choices}
                    if include_usage:
                        c["usage"] = self._usage(prompt_lens, latest) if continuous else None
                    yield c
            usage = self._usage(prompt_lens, streams.latest)
            self._record(t0, first_token, usage)
            if include_usage:
                yield {**head, "choices": [], "usage": usage}
        finally:
            await streams.close()


def prompt_logprobs_entries(positions: list | None) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: {"logprob",
    "rank", "decoded_token"}} (the prompt's own token and the top candidates)."""
    return [
        None
        if pos is None
        else {
            str(tid): {
                "logprob": _logprob(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for tid, lp in pos.items()
        }
        for pos in positions or []
    ]


def _joined(a: ReplyDelta, b: ReplyDelta) -> ReplyDelta:
    return ReplyDelta(a.reasoning + b.reasoning, a.content + b.content, a.tool_calls + b.tool_calls)


def tool_settings(settings: Settings, chat_template: str | None) -> ToolSettings:
    """The parser for tool_choice "auto": TOOL_CALL_PARSER, else the template's format, unless
    ENABLE_AUTO_TOOL_CHOICE is false."""
    name = settings.tool_call_parser or detect_tool_parser(chat_template)
    if settings.enable_auto_tool_choice is False:
        return ToolSettings(
            None,
            "is off (ENABLE_AUTO_TOOL_CHOICE=false); send tool_choice "
            '"required" or a named function, or set it true',
        )
    if name in (None, "none"):
        if settings.enable_auto_tool_choice:
            raise ValueError(
                "ENABLE_AUTO_TOOL_CHOICE: true needs a TOOL_CALL_PARSER (hermes, llama3_json, "
                "mistral); this model's chat template shows no format to read calls in"
            )
        return ToolSettings(
            None,
            "needs TOOL_CALL_PARSER (hermes, llama3_json, mistral); send "
            'tool_choice "required" or a named function instead',
        )
    return ToolSettings(tool_call_parser(name))


def reasoning_rules(settings: Settings, chat_template: str | None) -> ReasoningParser | None:
    """REASONING_PARSER, else the one the template calls for; None: thinking stays in content."""
    name = settings.reasoning_parser or detect_reasoning_parser(chat_template)
    return None if name in (None, "none") else reasoning_parser(name)


def coldbrew_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("coldbrew")
    except PackageNotFoundError:
        return "unknown"


def sse(chunk: dict) -> str:
    """One server-sent event carrying a chunk; the stream ends with `data: [DONE]`."""
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
