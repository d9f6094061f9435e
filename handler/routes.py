"""The OpenAI routes (/v1/models, /v1/chat/completions, /v1/completions), one implementation for both faces:
RunPod jobs (handler.jobs) and the HTTP server (handler.server) call `OpenAIRoutes.dispatch(route, body)`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ValidationError

from handler.config import Settings
from handler.metrics import Metrics
from handler.request_streams import ChunkStream, RequestStreams, drain
from handler.protocol import (UNSUPPORTED_EXTRAS, ChatCompletionRequest, CompletionRequest, SamplingFields,
                              describe_validation_error)

log = logging.getLogger(__name__)

ROUTES = ("/v1/models", "/v1/chat/completions", "/v1/completions")
# Most choices (prompts x n) one completions request may ask for.
MAX_CHOICES = 1024
# JSON has no infinity: a logprob of -inf is sent as this (as vLLM does).
MIN_LOGPROB = -9999.0
# Keys of chat_template_kwargs that would change more than template variables (e.g. load a template from a path).
_RESERVED_TEMPLATE_KWARGS = {"messages", "chat_template", "tools", "documents", "add_generation_prompt"}
_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
                503: "service_unavailable"}


class ApiError(Exception):
    """An error the caller caused (4xx) or one of ours (5xx), shaped like OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


def normalize_route(route: Any) -> str:
    """'/openai/v1/chat/completions/', 'v1/models' ... -> the canonical '/v1/...' path (unknown ones unchanged)."""
    if not isinstance(route, str):
        raise ApiError(400, f"openai_route: must be a string, got {type(route).__name__}", "openai_route")
    path = "/" + route.strip().strip("/")
    if path.startswith("/openai/"):
        path = path[len("/openai"):]
    return path


def _value_error(exc: ValueError, default_param: str) -> ApiError:
    """The engine's ValueErrors start with the field name ('temperature: must be ...')."""
    message = str(exc)
    head = message.split(":", 1)[0]
    param = head if head and head.replace("_", "").isalnum() and " " not in head else default_param
    return ApiError(400, message, param)


def _parse(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise ApiError(400, f"body: must be a JSON object, got {type(body).__name__}", "body")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        param, message = describe_validation_error(e.errors())
        raise ApiError(400, message, param) from None


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
        """What choice `c` (its cumulative output) adds since the last chunk, recorded as sent: (new text, new token
        ids, tokens sent before, text length sent before); None when there is nothing new to send."""
        if self.finished:
            return None
        delta_text = c.text[self.text_len:]
        new_ids = c.token_ids[self.tokens:]
        if not delta_text and not new_ids and c.finish_reason is None:
            return None
        tokens_before, text_before = self.tokens, self.text_len
        self.text_len, self.tokens = len(c.text), len(c.token_ids)
        self.finished = c.finish_reason is not None
        return delta_text, new_ids, tokens_before, text_before


class OpenAIRoutes:
    """`await routes.dispatch(route, body)` -> a response dict, or an async iterator of chunk dicts when
    body["stream"] is true. Errors raise ApiError with the HTTP status and the field at fault."""

    def __init__(self, engine, settings: Settings, served_names: list[str], metrics: Metrics | None = None):
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
        self.context_limit: int = core.context_limit
        self.max_model_len: int = core.max_model_len
        # Each token spans at most this many characters, so a text of C characters has at least C / this tokens.
        self.max_token_chars = max(1, max(map(len, self.tokenizer.backend.get_vocab(with_added_tokens=True))))
        self.created = int(time.time())

    # ---- entry point -------------------------------------------------------------------------------------------
    async def dispatch(self, route: str, body: Any) -> dict | AsyncIterator[dict]:
        path = normalize_route(route)
        if path == "/v1/models":
            return self.models()
        if path == "/v1/chat/completions":
            return await self._counted(path, self._chat(body))
        if path == "/v1/completions":
            return await self._counted(path, self._completion(body))
        raise ApiError(404, f"route {route!r} does not exist; the routes are {', '.join(ROUTES)} "
                            "(also under /openai/v1/...)", "openai_route")

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
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "coldbrew",
             "max_model_len": self.max_model_len} for name in self.served_names]}

    # ---- shared checks -----------------------------------------------------------------------------------------
    def _model(self, requested: str | None) -> str:
        if requested is None:
            return self.served_names[0]
        if requested not in self.served_names:
            raise ApiError(404, f"model: {requested[:200]!r} does not exist; this worker serves "
                                f"{', '.join(map(repr, self.served_names))}", "model", "not_found_error")
        return requested

    def _refuse_unsupported(self, req: SamplingFields) -> None:
        fmt = req.response_format
        if fmt is not None and fmt.type != "text":
            raise ApiError(400, f"response_format: type {fmt.type!r} is not supported (this engine has no guided "
                                "decoding); use {'type': 'text'}", "response_format")
        for name in UNSUPPORTED_EXTRAS:
            if getattr(req, name) is not None:
                raise ApiError(400, f"{name}: guided decoding is not supported by this engine", name)
        if req.use_beam_search:
            raise ApiError(400, "use_beam_search: beam search is not supported by this engine", "use_beam_search")
        if req.logit_bias:
            raise ApiError(400, "logit_bias: not supported by this engine; leave it empty", "logit_bias")
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options: only allowed when stream is true", "stream_options")

    def _check_chars(self, chars: int, param: str) -> None:
        """Refuse a text that can't fit before spending time tokenizing it."""
        if chars > self.context_limit * self.max_token_chars:
            raise ApiError(400, f"{param}: {chars} characters can't fit in the context limit of {self.context_limit} "
                                f"tokens (a token here spans at most {self.max_token_chars} characters)", param)

    @staticmethod
    def _check_unicode(text: str, param: str) -> None:
        """JSON escapes can carry lone surrogates (\\ud800), which are no text and can't be tokenized."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ApiError(400, f"{param}: invalid unicode (a lone surrogate) at character {e.start}", param) from None

    def _max_tokens(self, requested: int | None, param: str, prompt_lens: list[int], prompt_param: str) -> int | None:
        longest = max(prompt_lens)
        if longest + 1 > self.context_limit:
            raise ApiError(400, f"{prompt_param}: {longest} tokens exceed the context limit of {self.context_limit} "
                                f"tokens (the prompt may have at most {self.context_limit - 1} tokens)", prompt_param)
        remaining = self.context_limit - longest
        if requested is not None:
            if requested > remaining:
                raise ApiError(400, f"{param}: {requested} plus the prompt's {longest} tokens exceeds the context "
                                    f"limit of {self.context_limit} tokens (at most {remaining} for this prompt)",
                               param)
            return requested
        default = self.settings.default_max_tokens
        return min(default, remaining) if default is not None else None  # None: until EOS or the context limit

    def _sampling(self, req: SamplingFields, max_tokens: int | None, logprobs: int | None):
        from engine import SamplingParams

        kwargs: dict[str, Any] = dict(
            n=req.n, max_tokens=max_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids, seed=req.seed,
            min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(req, name)
            if value is not None:
                kwargs[name] = value
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            raise _value_error(e, "body") from None

    async def _start(self, request_id: str, prompts: list[list[int]], params) -> RequestStreams:
        streams = RequestStreams(self.engine, request_id, prompts, params)
        try:
            await streams.start()
        except ValueError as e:
            raise _value_error(e, "prompt") from None
        return streams

    def _usage(self, prompt_lens: list[int], latest: dict[int, Any]) -> dict:
        prompt = sum(prompt_lens)
        completion = sum(len(c.token_ids) for out in latest.values() for c in out.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

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

    # ---- logprobs formats --------------------------------------------------------------------------------------
    def _chat_logprobs(self, token_ids: list[int], positions: list, top_n: int) -> list[dict]:
        content = []
        for token_id, pos in zip(token_ids, positions):
            text = self._token_text(pos, token_id)
            chosen = pos.get(token_id) if pos else None
            top = sorted(((tid, lp) for tid, lp in (pos or {}).items() if lp.rank <= top_n), key=lambda t: t[1].rank)
            content.append({
                "token": text, "logprob": _logprob(chosen.logprob) if chosen else MIN_LOGPROB,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [{"token": (t := self._token_text(pos, tid)), "logprob": _logprob(lp.logprob),
                                  "bytes": list(t.encode("utf-8"))} for tid, lp in top[:top_n]]})
        return content

    def _completion_logprobs(self, token_ids: list[int], positions: list, top_n: int, offset: int) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, pos in zip(token_ids, positions):
            text = self._token_text(pos, token_id)
            chosen = pos.get(token_id) if pos else None
            out["tokens"].append(text)
            out["token_logprobs"].append(_logprob(chosen.logprob) if chosen else None)
            top = sorted(((tid, lp) for tid, lp in (pos or {}).items() if lp.rank <= top_n), key=lambda t: t[1].rank)
            out["top_logprobs"].append({self._token_text(pos, tid): _logprob(lp.logprob) for tid, lp in top[:top_n]})
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    # ---- /v1/chat/completions ----------------------------------------------------------------------------------
    async def _chat(self, body: Any) -> dict | AsyncIterator[dict]:
        t0 = time.monotonic()
        req: ChatCompletionRequest = _parse(ChatCompletionRequest, body)
        model = self._model(req.model)
        self._refuse_unsupported(req)
        if req.continue_final_message:
            raise ApiError(400, "continue_final_message: not supported; end the conversation with a user turn",
                           "continue_final_message")
        if req.tools and req.tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice: only 'auto' and 'none' are supported (no forced tool calls)",
                           "tool_choice")
        kwargs = dict(req.chat_template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise ApiError(400, f"chat_template_kwargs: may not set {', '.join(reserved)}", "chat_template_kwargs")
        chars = sum(len(m.content) if isinstance(m.content, str) else sum(len(getattr(p, "text", "")) for p in
                    m.content or []) for m in req.messages)
        self._check_chars(chars, "messages")
        for i, m in enumerate(req.messages):
            parts = [m.content] if isinstance(m.content, str) else [getattr(p, "text", "") for p in m.content or []]
            for text in parts:
                self._check_unicode(text, f"messages[{i}].content")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        tools = req.tools if req.tool_choice != "none" else None
        try:
            prompt_ids = await asyncio.to_thread(
                self.tokenizer.encode_chat, messages, add_generation_prompt=req.add_generation_prompt, tools=tools,
                **kwargs)
        except (ValueError, TypeError) as e:
            raise ApiError(400, f"messages: {e}", "messages") from None
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self._max_tokens(requested, param, [len(prompt_ids)], "messages")
        top_n = (req.top_logprobs or 0) if req.logprobs else 0
        params = self._sampling(req, max_tokens, top_n if req.logprobs else None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._start(rid, [prompt_ids], params)
        head = {"id": rid, "created": int(time.time()), "model": model}
        if req.stream:
            return ChunkStream(self._chat_stream(streams, head, req, [len(prompt_ids)], top_n, t0), streams)
        return await self._chat_full(streams, head, req, [len(prompt_ids)], top_n, t0)

    async def _chat_full(self, streams: RequestStreams, head: dict, req, prompt_lens, top_n, t0) -> dict:
        first_token = await drain(streams)
        out = streams.latest[0]
        choices = []
        for c in out.outputs:
            choices.append({
                "index": c.index,
                "message": {"role": self.settings.openai_response_role, "content": c.text},
                "logprobs": {"content": self._chat_logprobs(c.token_ids, c.logprobs or [], top_n)}
                if req.logprobs else None,
                "finish_reason": c.finish_reason,
            })
        usage = self._usage(prompt_lens, streams.latest)
        self._record(t0, first_token, usage)
        return {**head, "object": "chat.completion", "choices": choices, "usage": usage}

    async def _chat_stream(self, streams: RequestStreams, head: dict, req, prompt_lens, top_n, t0) -> AsyncIterator[dict]:
        head = {**head, "object": "chat.completion.chunk"}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
        states = [_ChoiceState() for _ in range(req.n)]
        role = self.settings.openai_response_role
        first_token = None

        def chunk(choices: list[dict], latest) -> dict:
            c = {**head, "choices": choices}
            if include_usage:
                c["usage"] = self._usage(prompt_lens, latest) if continuous else None
            return c

        try:
            yield chunk([{"index": i, "delta": {"role": role, "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(req.n)], streams.latest)
            async for latest in streams.updates():
                choices = []
                for c in latest[0].outputs:
                    st = states[c.index]
                    sent = st.advance(c)
                    if sent is None:
                        continue
                    delta_text, new_ids, tokens_before, _ = sent
                    choice: dict[str, Any] = {"index": c.index, "delta": {"content": delta_text} if delta_text else {},
                                              "logprobs": None, "finish_reason": c.finish_reason}
                    if req.logprobs and new_ids:
                        choice["logprobs"] = {"content": self._chat_logprobs(
                            new_ids, (c.logprobs or [])[tokens_before:], top_n)}
                    if delta_text or st.finished or choice["logprobs"]:
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

    # ---- /v1/completions ---------------------------------------------------------------------------------------
    async def _completion(self, body: Any) -> dict | AsyncIterator[dict]:
        t0 = time.monotonic()
        req: CompletionRequest = _parse(CompletionRequest, body)
        model = self._model(req.model)
        self._refuse_unsupported(req)
        if req.suffix:
            raise ApiError(400, "suffix: not supported (no fill-in-the-middle)", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise ApiError(400, f"best_of: only best_of == n is supported (got best_of={req.best_of}, n={req.n})",
                           "best_of")
        if req.echo and req.logprobs is not None:
            raise ApiError(400, "echo: echo together with logprobs is not supported", "echo")
        raw = req.prompt
        if isinstance(raw, str):
            texts, prompts = [raw], None
        elif isinstance(raw[0], str):
            texts, prompts = list(raw), None
        elif isinstance(raw[0], int):
            texts, prompts = None, [list(raw)]
        else:
            texts, prompts = None, [list(p) for p in raw]
        if texts is not None:
            for i, text in enumerate(texts):
                self._check_chars(len(text), "prompt" if len(texts) == 1 else f"prompt[{i}]")
                self._check_unicode(text, "prompt" if len(texts) == 1 else f"prompt[{i}]")
            if any(not t for t in texts):
                raise ApiError(400, "prompt: must not be empty", "prompt")
            prompts = await asyncio.to_thread(lambda: [self.tokenizer.encode(t) for t in texts])
        else:
            vocab = self.engine.engine.model_config.vocab_size
            for i, ids in enumerate(prompts):
                bad = next((t for t in ids if not 0 <= t < vocab), None)
                if bad is not None:
                    raise ApiError(400, f"prompt: token ids must be in [0, {vocab}), got {bad}", "prompt")
            texts = None
        if len(prompts) * req.n > MAX_CHOICES:
            raise ApiError(400, f"n: {req.n} samples of {len(prompts)} prompts make {req.n * len(prompts)} choices; "
                                f"at most {MAX_CHOICES} per request", "n")
        max_tokens = self._max_tokens(req.max_tokens, "max_tokens", [len(p) for p in prompts], "prompt")
        top_n = req.logprobs or 0
        params = self._sampling(req, max_tokens, req.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._start(rid, prompts, params)
        echo = None
        if req.echo:
            echo = texts or [self.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
        head = {"id": rid, "created": int(time.time()), "model": model}
        lens = [len(p) for p in prompts]
        if req.stream:
            return ChunkStream(self._completion_stream(streams, head, req, lens, top_n, echo, t0), streams)
        return await self._completion_full(streams, head, req, lens, top_n, echo, t0)

    async def _completion_full(self, streams: RequestStreams, head: dict, req, prompt_lens, top_n, echo, t0) -> dict:
        first_token = await drain(streams)
        choices = []
        for i in range(len(prompt_lens)):
            for c in streams.latest[i].outputs:
                prefix = echo[i] if echo else ""
                choices.append({
                    "index": i * req.n + c.index, "text": prefix + c.text,
                    "logprobs": self._completion_logprobs(c.token_ids, c.logprobs or [], top_n, len(prefix))
                    if req.logprobs is not None else None,
                    "finish_reason": c.finish_reason,
                })
        usage = self._usage(prompt_lens, streams.latest)
        self._record(t0, first_token, usage)
        return {**head, "object": "text_completion", "choices": choices, "usage": usage}

    async def _completion_stream(self, streams: RequestStreams, head: dict, req, prompt_lens, top_n, echo,
                                 t0) -> AsyncIterator[dict]:
        head = {**head, "object": "text_completion"}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
        states = {(i, j): _ChoiceState() for i in range(len(prompt_lens)) for j in range(req.n)}
        first_token = None
        try:
            if echo:
                first = [{"index": i * req.n + j, "text": echo[i], "logprobs": None, "finish_reason": None}
                         for i in range(len(prompt_lens)) for j in range(req.n)]
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
                        choice = {"index": i * req.n + c.index, "text": delta_text, "logprobs": None,
                                  "finish_reason": c.finish_reason}
                        if req.logprobs is not None and new_ids:
                            choice["logprobs"] = self._completion_logprobs(
                                new_ids, (c.logprobs or [])[tokens_before:], top_n, offset)
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


def sse(chunk: dict) -> str:
    """One server-sent event carrying a chunk; the stream ends with `data: [DONE]`."""
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
