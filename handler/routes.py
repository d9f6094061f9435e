"""The OpenAI routes (/v1/models, /v1/chat/completions, /v1/completions, /v1/responses, tokenize),
one implementation for both faces: RunPod jobs (handler.jobs) and the HTTP server (handler.server)
call `OpenAIRoutes.dispatch(route, body)`. A chat or completions request is parsed and started here;
its answer is written by handler.serving_chat or handler.serving_completion.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from handler import responses_api
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
from handler.request_streams import ChunkStream, RequestStreams
from handler.serving_base import Answer
from handler.serving_chat import ChatServing
from handler.serving_completion import CompletionServing
from handler.token_routes import TokenRoutes
from handler.tool_parsers import detect_tool_parser, tool_call_parser


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
        self.chat = ChatServing(self.tokenizer, settings, metrics)
        self.completion = CompletionServing(self.tokenizer, settings, metrics)

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
        answer = Answer(streams, head, request, t0)
        if route == CHAT_ROUTE:
            if req.stream:
                return ChunkStream(self.chat.stream(answer), streams)
            return await self.chat.full(answer)
        echo = None
        if req.echo:
            echo = request.texts or [
                self.tokenizer.decode(p, skip_special_tokens=False) for p in request.prompts
            ]
        if req.stream:
            return ChunkStream(self.completion.stream(answer, echo), streams)
        return await self.completion.full(answer, echo)

    async def _start(self, request_id: str, request: EngineRequest) -> RequestStreams:
        streams = RequestStreams(self.engine, request_id, request.prompts, request.params)
        try:
            await streams.start()
        except ValueError as e:
            raise request.engine_error(e) from None
        return streams


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
