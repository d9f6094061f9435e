"""One meaning for one input: every request of both faces (the HTTP routes, and RunPod jobs of
every shape, which handler.jobs turns into OpenAI bodies) is parsed by the same schemas and
normalised here once (nesting depth, messages, tools, sampling fields, the context limit) into an
EngineRequest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from handler.limits import MAX_CHOICES, MAX_JSON_DEPTH
from handler.output_rules import (
    ReplyRules,
    ToolSettings,
    output_grammar,
    renamed_grammar_error,
    tool_rules,
)
from handler.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    describe_validation_error,
)
from handler.reasoning import THINK_CLOSE, ReasoningParser

MODELS_ROUTE = "/v1/models"
CHAT_ROUTE = "/v1/chat/completions"
COMPLETIONS_ROUTE = "/v1/completions"
RESPONSES_ROUTE = "/v1/responses"  # text, mapped onto a chat completion (handler.responses_api)
# vLLM's own routes, outside /v1
TOKENIZE_ROUTE = "/tokenize"
DETOKENIZE_ROUTE = "/detokenize"
VERSION_ROUTE = "/version"
ROUTES = (
    MODELS_ROUTE,
    CHAT_ROUTE,
    COMPLETIONS_ROUTE,
    RESPONSES_ROUTE,
    TOKENIZE_ROUTE,
    DETOKENIZE_ROUTE,
    VERSION_ROUTE,
)
# The method each route answers (as the OpenAI API and vLLM do).
ROUTE_METHODS = {
    MODELS_ROUTE: "GET",
    CHAT_ROUTE: "POST",
    COMPLETIONS_ROUTE: "POST",
    RESPONSES_ROUTE: "POST",
    TOKENIZE_ROUTE: "POST",
    DETOKENIZE_ROUTE: "POST",
    VERSION_ROUTE: "GET",
}
_SCHEMAS = {CHAT_ROUTE: ChatCompletionRequest, COMPLETIONS_ROUTE: CompletionRequest}
# The request fields that become the engine's SamplingParams (a job's sampling_params may set them).
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "prompt_logprobs",
)
# Keys of chat_template_kwargs that would change more than template variables (e.g. load a
# template from a path).
_RESERVED_TEMPLATE_KWARGS = {
    "messages",
    "chat_template",
    "tools",
    "documents",
    "add_generation_prompt",
}


_FIELD_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\])*")


def canonical_route(route: Any, param: str = "route") -> str:
    """'/openai/v1/chat/completions/', 'v1/models', 'chat/completions' -> '/v1/...' (an unknown
    route stays unknown)."""
    if not isinstance(route, str):
        raise ApiError(400, f"{param}: must be a string, got {type(route).__name__}", param)
    path = "/" + route.strip().strip("/")
    if path.startswith("/openai/"):
        path = path[len("/openai") :]
    if not path.startswith("/v1/") and "/v1" + path in ROUTES:
        path = "/v1" + path
    return path


def check_depth(value: Any, where: str = "body", slack: int = 0) -> None:
    """Refuse objects and lists nested deeper than MAX_JSON_DEPTH (+ slack), naming the top-level
    field that holds them. An explicit stack, never recursion: this runs before anything that
    recurses (validation, templates, repr) sees the value. `slack` lets a RunPod job's `input`
    (whose sampling_params or openai_input sit a level deeper than in the OpenAI body they become)
    through to parse_body, which checks that body exactly."""
    stack = [(value, 1, None)]
    while stack:
        node, depth, top = stack.pop()
        if depth > MAX_JSON_DEPTH + slack:
            param = top if isinstance(top, str) else where
            raise ApiError(
                400,
                f"{param}: objects and lists nested deeper than the limit of "
                f"{MAX_JSON_DEPTH} levels",
                param,
            )
        for key, child in node.items() if isinstance(node, dict) else enumerate(node):
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1, key if top is None else top))


def parse_body(route: str, body: Any) -> ChatCompletionRequest | CompletionRequest:
    """A chat or completions body -> its validated request, with every check that needs no model;
    ApiError(400) naming the field otherwise."""
    if not isinstance(body, dict):
        raise ApiError(400, f"body: must be a JSON object, got {type(body).__name__}", "body")
    check_depth(body)
    try:
        req = _SCHEMAS[route].model_validate(body)
    except ValidationError as e:
        param, message = describe_validation_error(e.errors())
        raise ApiError(400, message, param) from None
    _refuse_unsupported(req)
    if route == CHAT_ROUTE:
        _check_chat(req)
    else:
        _check_completion(req)
    return req


@dataclass
class EngineRequest:
    """What the engine runs for one request: prompt token ids (a list each) and SamplingParams."""

    route: str
    parsed: ChatCompletionRequest | CompletionRequest
    model: str
    prompts: list[list[int]]
    params: Any  # engine.SamplingParams
    top_n: int = 0  # logprobs shown per token
    texts: list[str] | None = None  # the prompts as given, when text (echo)
    reply: ReplyRules | None = None  # chat: how the reply is read (reasoning, tool calls)
    grammar_field: str | None = None  # the request field that asked for params' grammar

    def engine_error(self, exc: ValueError) -> ApiError:
        """The engine's refusal of this request as a 400 naming the request's own field."""
        message = renamed_grammar_error(str(exc), self.grammar_field)
        return engine_error(ValueError(message), "prompt")


def _refuse_unsupported(req: SamplingFields) -> None:
    if req.use_beam_search:
        raise ApiError(
            400, "use_beam_search: beam search is not supported by this engine", "use_beam_search"
        )
    if req.prompt_logprobs is not None and req.stream:
        raise ApiError(
            400,
            "prompt_logprobs: not supported with stream: true; send the request unstreamed",
            "prompt_logprobs",
        )
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", "stream_options")
    for name in ("guided_whitespace_pattern",):
        if getattr(req, name) is not None and not any(
            getattr(req, g) is not None for g in ("guided_json", "guided_choice")
        ):
            raise ApiError(400, f"{name}: only applies with guided_json or guided_choice", name)


def logit_bias(req: SamplingFields, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON object keys) -> {token id: bias}; 400 naming a key
    that is not a token id of this model."""
    if not req.logit_bias:
        return None
    out = {}
    for key, value in req.logit_bias.items():
        if not key.isascii() or not key.isdigit() or int(key) >= vocab_size:
            raise ApiError(
                400,
                f"logit_bias: keys must be token ids in [0, {vocab_size}), got {key[:20]!r}",
                "logit_bias",
            )
        out[int(key)] = value
    return out


def _refuse_functions(req: ChatCompletionRequest) -> None:
    """The deprecated function-calling fields: refused with what to send instead."""
    for name, instead in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(req, name) is not None:
            raise ApiError(
                400, f"{name}: the deprecated form is not supported; send {instead}", name
            )
    for i, m in enumerate(req.messages):
        if m.role == "function" or (m.model_extra or {}).get("function_call") is not None:
            raise ApiError(
                400,
                f"messages[{i}]: function messages and function_call are the deprecated forms; "
                "send tool messages and tool_calls",
                f"messages[{i}]",
            )


def template_messages(req: ChatCompletionRequest) -> list[dict]:
    """The messages as the chat template reads them: content parts stay a list (the template joins
    text parts with "\n", as vLLM's do, or loops over them); a tool call's arguments, JSON text in
    the API, become the object templates render with tojson; null content is empty text (as vLLM
    gives both)."""
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    for i, m in enumerate(messages):
        m.setdefault("content", "")  # null content (an assistant turn of calls) renders as empty
        for j, call in enumerate(m.get("tool_calls") or []):
            fn = call.get("function") if isinstance(call, dict) else None
            where = f"messages[{i}].tool_calls[{j}]"
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ApiError(
                    400,
                    f'{where}: expected {{"function": {{"name": ..., "arguments": ...}}}}',
                    where,
                )
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    fn["arguments"] = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise ApiError(
                        400,
                        f"{where}.function.arguments: not valid JSON",
                        f"{where}.function.arguments",
                    ) from None
    return messages


def _texts(message) -> list[str]:
    content = message.content
    if isinstance(content, str):
        return [content]
    return [getattr(p, "text", "") for p in content or []]


def _check_chat(req: ChatCompletionRequest) -> None:
    _refuse_functions(req)
    if req.tool_choice not in (None, "none") and not req.tools:
        raise ApiError(400, "tool_choice: needs tools; send tools or leave it out", "tool_choice")
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise ApiError(
                400,
                "continue_final_message: needs add_generation_prompt false (the reply continues "
                "the last message instead of starting a new one)",
                "continue_final_message",
            )
        if req.messages[-1].role != "assistant":
            raise ApiError(
                400,
                "continue_final_message: the last message must be the assistant's",
                "continue_final_message",
            )
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & (req.chat_template_kwargs or {}).keys())
    if reserved:
        raise ApiError(
            400, f"chat_template_kwargs: may not set {', '.join(reserved)}", "chat_template_kwargs"
        )
    for i, m in enumerate(req.messages):
        for text in _texts(m):
            _check_unicode(text, f"messages[{i}].content")


def _check_completion(req: CompletionRequest) -> None:
    if req.suffix:
        raise ApiError(400, "suffix: not supported (no fill-in-the-middle)", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError(
            400,
            f"best_of: only best_of == n is supported (got best_of={req.best_of}, n={req.n})",
            "best_of",
        )
    if req.echo and req.logprobs is not None:
        raise ApiError(400, "echo: echo together with logprobs is not supported", "echo")
    prompt = req.prompt
    texts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt[0], str) else []
    for i, text in enumerate(texts):
        _check_unicode(text, "prompt" if len(texts) == 1 else f"prompt[{i}]")
    if any(not t for t in texts):
        raise ApiError(400, "prompt: must not be empty", "prompt")


def _cut_after_final_message(text: str, message) -> str:
    """continue_final_message: the rendered prompt ends right after the last message's text (the
    template's end-of-turn after it is cut), so the reply continues that text."""
    final = "".join(_texts(message))
    at = text.rfind(final) if final else -1
    if at < 0:
        raise ApiError(
            400,
            "continue_final_message: the chat template does not render the last message's text "
            "as given, so it cannot be continued",
            "continue_final_message",
        )
    return text[: at + len(final)]


def _check_unicode(text: str, param: str) -> None:
    """JSON escapes can carry lone surrogates (\\ud800): no text, and they can't be tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(
            400, f"{param}: invalid unicode (a lone surrogate) at character {e.start}", param
        ) from None


def engine_error(exc: ValueError, default_param: str) -> ApiError:
    """An engine refusal as a 400: its ValueErrors start with the field ('temperature: ...')."""
    message = str(exc)
    head = message.split(":", 1)[0]
    param = head if _FIELD_PATH.fullmatch(head) else default_param
    return ApiError(400, message, param)


class RequestBuilder:
    """Parsed requests -> EngineRequests, with the checks that need the model: served names, the
    context limit, the vocabulary, the chat template."""

    def __init__(
        self,
        tokenizer,
        context_limit: int,
        vocab_size: int,
        served_names: list[str],
        default_max_tokens: int | None,
        tool_settings: ToolSettings | None = None,
        reasoning: ReasoningParser | None = None,
        generation_defaults: dict[str, Any] | None = None,
    ):
        """tool_settings: the parser for tool_choice "auto"; reasoning: the REASONING_PARSER;
        generation_defaults: sampling fields a request leaves unset take these (the model's
        generation_config.json)."""
        self.tokenizer = tokenizer
        self.context_limit = context_limit
        self.vocab_size = vocab_size
        self.served_names = served_names
        self.default_max_tokens = default_max_tokens
        self.tool_settings = tool_settings or ToolSettings(None, "needs TOOL_CALL_PARSER")
        self.reasoning = reasoning
        self.generation_defaults = dict(generation_defaults or {})

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Each token spans at most this many characters: a text of C characters has at least
        C / this tokens. Read from the vocabulary on the first text longer than the context limit
        (a shorter one always passes check_chars): not on the first request's path."""
        vocab = self.tokenizer.backend.get_vocab(with_added_tokens=True)
        return max(1, max(map(len, vocab)))

    def model(self, requested: str | None) -> str:
        if requested is None:
            return self.served_names[0]
        if requested not in self.served_names:
            raise ApiError(
                404,
                f"model: {requested[:200]!r} does not exist; this worker serves "
                f"{', '.join(map(repr, self.served_names))}",
                "model",
                "not_found_error",
            )
        return requested

    async def build(self, route: str, req) -> EngineRequest:
        if route == CHAT_ROUTE:
            return await self._chat(req)
        return await self._completion(req)

    def check_chars(self, chars: int, param: str) -> None:
        """Refuse a text that can't fit before spending time tokenizing it."""
        if chars > self.context_limit and chars > self.context_limit * self.max_token_chars:
            raise ApiError(
                400,
                f"{param}: {chars} characters can't fit in the context limit of "
                f"{self.context_limit} tokens (a token here spans at most "
                f"{self.max_token_chars} characters)",
                param,
            )

    def _max_tokens(
        self, requested: int | None, param: str, prompt_lens: list[int], prompt_param: str
    ) -> int | None:
        longest, limit = max(prompt_lens), self.context_limit
        if longest + 1 > limit:
            raise ApiError(
                400,
                f"{prompt_param}: {longest} tokens exceed the context limit of "
                f"{limit} tokens (the prompt may have at most {limit - 1} tokens)",
                prompt_param,
            )
        remaining = limit - longest
        if requested is not None:
            if requested > remaining:
                raise ApiError(
                    400,
                    f"{param}: {requested} plus the prompt's {longest} tokens "
                    f"exceeds the context limit of {limit} tokens (at most "
                    f"{remaining} for this prompt)",
                    param,
                )
            return requested
        default = self.default_max_tokens
        # None: until EOS or the context limit
        return min(default, remaining) if default is not None else None

    def _sampling(
        self, req: SamplingFields, max_tokens: int | None, logprobs: int | None, grammar=None
    ):
        from engine import SamplingParams  # the engine (and torch) load once a request needs them

        kwargs: dict[str, Any] = {
            name: getattr(req, name) for name in SAMPLING_FIELDS if getattr(req, name) is not None
        }
        for name, value in self.generation_defaults.items():
            kwargs.setdefault(name, value)
        kwargs.update(max_tokens=max_tokens, logprobs=logprobs)
        kwargs.update(logit_bias=logit_bias(req, self.vocab_size), structured_outputs=grammar)
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            raise engine_error(e, "body") from None

    def render_chat(self, req: ChatCompletionRequest, tools: list[dict] | None) -> str:
        """The prompt text of a chat request (its template, its tools, its kwargs)."""
        kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort == "none":  # no thinking: the templates' switch for it
            kwargs.setdefault("enable_thinking", False)
        elif req.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        messages = template_messages(req)
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=req.add_generation_prompt,
                tools=tools,
                **kwargs,
            )
        except (ValueError, TypeError) as e:
            raise ApiError(400, f"messages: {e}", "messages") from None
        if req.continue_final_message:
            text = _cut_after_final_message(text, req.messages[-1])
        return text

    def _reply_rules(self, prompt_text: str, tool_parser, grammar) -> tuple[ReplyRules, Any]:
        """How the reply is read, and the grammar adjusted to it: a grammar starts after the
        reasoning when the reply begins inside it and `</think>` is one token; otherwise the grammar
        leaves no room to think and the reply is read without a reasoning part."""
        reasoning = self.reasoning
        if grammar is not None and reasoning is not None:
            if reasoning.stream(prompt_text).in_reasoning:
                end = self.tokenizer.token_to_id(THINK_CLOSE)
                if end is not None:
                    grammar = dataclasses.replace(grammar, start_after_token=end)
                else:
                    reasoning = None
            else:
                reasoning = None
        return ReplyRules(reasoning, prompt_text, tool_parser), grammar

    async def _chat(self, req: ChatCompletionRequest) -> EngineRequest:
        model = self.model(req.model)
        self.check_chars(sum(len(t) for m in req.messages for t in _texts(m)), "messages")
        tools, forced_schema, tool_parser = tool_rules(req, self.tool_settings)
        grammar, grammar_field = output_grammar(req, forced_schema)
        text = await asyncio.to_thread(self.render_chat, req, tools)
        prompt_ids = await asyncio.to_thread(self.tokenizer.encode, text, False)
        if req.max_completion_tokens is not None:
            param, requested = "max_completion_tokens", req.max_completion_tokens
        else:
            param, requested = "max_tokens", req.max_tokens
        max_tokens = self._max_tokens(requested, param, [len(prompt_ids)], "messages")
        top_n = (req.top_logprobs or 0) if req.logprobs else 0
        reply, grammar = self._reply_rules(text, tool_parser, grammar)
        params = self._sampling(req, max_tokens, top_n if req.logprobs else None, grammar)
        if tool_parser is not None and tool_parser.name == "mistral":
            params.skip_special_tokens = False  # [TOOL_CALLS] is a special token the parser reads
        return EngineRequest(
            CHAT_ROUTE,
            req,
            model,
            [prompt_ids],
            params,
            top_n,
            reply=reply,
            grammar_field=grammar_field,
        )

    async def _completion(self, req: CompletionRequest) -> EngineRequest:
        model = self.model(req.model)
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
                self.check_chars(len(text), "prompt" if len(texts) == 1 else f"prompt[{i}]")
            prompts = await asyncio.to_thread(lambda: [self.tokenizer.encode(t) for t in texts])
        else:
            for ids in prompts:
                bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
                if bad is not None:
                    raise ApiError(
                        400,
                        f"prompt: token ids must be in [0, {self.vocab_size}), got {bad}",
                        "prompt",
                    )
        choices = len(prompts) * req.n
        if choices > MAX_CHOICES:
            raise ApiError(
                400,
                f"n: {req.n} samples of {len(prompts)} prompts make {choices} "
                f"choices; at most {MAX_CHOICES} per request",
                "n",
            )
        lens = [len(p) for p in prompts]
        max_tokens = self._max_tokens(req.max_tokens, "max_tokens", lens, "prompt")
        grammar, grammar_field = output_grammar(req)
        params = self._sampling(req, max_tokens, req.logprobs, grammar)
        return EngineRequest(
            COMPLETIONS_ROUTE,
            req,
            model,
            prompts,
            params,
            req.logprobs or 0,
            texts,
            grammar_field=grammar_field,
        )
