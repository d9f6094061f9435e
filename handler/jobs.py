"""RunPod job inputs as worker-vllm accepts them (prompt/messages, openai_route, and v2.24+'s
route/body/method), each turned into the OpenAI request it stands for, so handler.engine_requests
gives it the meaning the HTTP face gives that body; and their outputs: worker-vllm-shaped chunks
streamed in batches whose token count grows from the min to the max.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from handler.engine_requests import (
    CHAT_ROUTE,
    COMPLETIONS_ROUTE,
    ROUTE_METHODS,
    ROUTES,
    SAMPLING_FIELDS,
    canonical_route,
    check_depth,
    parse_body,
)
from handler.protocol import ApiError, describe_validation_error
from handler.routes import SSE_DONE, sse

# What a prompt/messages job's sampling_params may hold: the sampling fields, and the tool fields
# (refused as on the OpenAI face). logprobs are refused: worker-vllm's output has no place for them.
_JOB_SAMPLING_KEYS = (*SAMPLING_FIELDS, "tools", "tool_choice")
_NO_LOGPROBS = (
    "worker-vllm's job output has no place for logprobs; send the request as "
    '{"openai_route": "/v1/chat/completions" or "/v1/completions", '
    '"openai_input": {...}}'
)


class JobInputError(ValueError):
    """A job input the worker can't serve; the message names the field and what it accepts.
    `error` is what the job answers: the message, or for the route/body/method form the OpenAI
    error object, as worker-vllm answers with one."""

    def __init__(self, message: str, error: str | dict | None = None):
        super().__init__(message)
        self.error = message if error is None else error


class JobAborted(RuntimeError):
    """The job's engine request was ended from outside (drain deadline, cancel): the job fails with
    this message."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


PositiveInt = Annotated[StrictInt, Field(ge=1, le=1_000_000)]


class _BatchOverrides(_Strict):
    """worker-vllm's per-job overrides of the stream batch sizes (DEFAULT_* settings otherwise)."""

    max_batch_size: PositiveInt | None = None
    min_batch_size: PositiveInt | None = None
    batch_size_growth_factor: Annotated[StrictFloat | StrictInt, Field(ge=1, le=1000)] | None = None


class EngineJob(_BatchOverrides):
    """`{"prompt": str | [ids] | "messages": [...], "sampling_params": {...}, "stream": bool}`."""

    prompt: (
        StrictStr | Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)] | None
    ) = None
    # validated as the chat route's messages
    messages: Annotated[list[Any], Field(min_length=1)] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    # a messages job's tools reach the template (the reply's text is returned as written)
    tools: Any = None
    tool_choice: Any = None
    stream: StrictBool = False
    apply_chat_template: StrictBool = False  # a string prompt becomes one user message
    use_openai_format: StrictBool = False  # answer as the OpenAI route does (its objects)

    @model_validator(mode="after")
    def _one_input(self) -> "EngineJob":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.apply_chat_template and not isinstance(self.prompt, str) and self.messages is None:
            raise ValueError("apply_chat_template needs a string prompt or messages")
        return self


class OpenAIJob(_BatchOverrides):
    """`{"openai_route": ROUTE, "openai_input": {...}}`, ROUTE one of "/v1/chat/completions",
    "/v1/completions", "/v1/models"."""

    openai_route: StrictStr
    openai_input: dict[str, Any] | None = None


class RouteJob(_BatchOverrides):
    """worker-vllm v2.24+: `{"route": "/v1/...", "body": {...}, "method": "POST"}`; without a
    method, a body POSTs and no body GETs."""

    route: StrictStr
    body: dict[str, Any] | None = None
    method: StrictStr | None = None


@dataclass
class Job:
    """A parsed job: the OpenAI route and body it stands for, how it answers, and how its errors
    name their field."""

    shape: EngineJob | OpenAIJob | RouteJob
    route: str
    body: dict = field(default_factory=dict)
    method: str | None = None
    # a string prompt with apply_chat_template: messages[0] is the prompt
    prompt_as_message: bool = False

    @property
    def openai_output(self) -> bool:
        """Answers with OpenAI objects and chunks (else worker-vllm's token batches)."""
        return not isinstance(self.shape, EngineJob) or self.shape.use_openai_format

    @property
    def stream(self) -> bool:
        if isinstance(self.shape, EngineJob):
            return self.shape.stream
        return self.body.get("stream") is True

    def answer(self, status: int, message: str) -> str | dict:
        """A failure as this job answers it: the message, or the OpenAI error object for the
        route/body form."""
        if isinstance(self.shape, RouteJob):
            return ApiError(status, message).to_dict()["error"]
        return message

    def error(self, e: ApiError) -> str | dict:
        """What the job answers for an error of its OpenAI request: the message, its field named
        from `input`."""
        if isinstance(self.shape, RouteJob):
            return e.to_dict()["error"]
        if e.param is None:
            return e.message
        param = e.param
        rest = e.message[len(param) :] if e.message.startswith(param) else f": {e.message}"
        if isinstance(self.shape, OpenAIJob):
            where = "input.openai_input" if param == "body" else f"input.openai_input.{param}"
        else:
            head = re.split(r"[.\[]", param, maxsplit=1)[0]
            if param == "body":
                where = "input"
            elif head in self.shape.sampling_params:
                where = f"input.sampling_params.{param}"
            elif self.prompt_as_message and head == "messages":
                where = "input.prompt"
            else:
                where = f"input.{param}"
        return where + rest

    def refusal(self, e: ApiError) -> JobInputError:
        answer = self.error(e)
        return JobInputError(answer if isinstance(answer, str) else e.message, answer)


def _shape_error(model: type[_Strict], errors: list[dict]) -> str:
    """pydantic's errors for the job's own fields -> one message naming `input.<field>`."""
    if any(e["type"] == "extra_forbidden" for e in errors):
        bad = next(e for e in errors if e["type"] == "extra_forbidden")["loc"][0]
        allowed = ", ".join(model.model_fields)
        return f"input.{bad}: unknown field; accepted: {allowed}"
    if any(e["type"] == "value_error" and not e["loc"] for e in errors):
        msg = next(e for e in errors if e["type"] == "value_error" and not e["loc"])["msg"]
        return f"input: {msg.removeprefix('Value error, ')}"
    return "input." + describe_validation_error(errors)[1]


def parse_job(raw: Any) -> Job:
    """A job's `input` -> the Job, its OpenAI body parsed. Raises JobInputError naming the field
    ("input.sampling_params.top_p: ...")."""
    if not isinstance(raw, dict):
        raise JobInputError(f"input: must be an object, got {type(raw).__name__}")
    model = OpenAIJob if "openai_route" in raw else RouteJob if "route" in raw else EngineJob

    def refuse(message: str, param: str | None) -> JobInputError:
        if model is not RouteJob:
            return JobInputError(message)
        return JobInputError(message, ApiError(400, message, param).to_dict()["error"])

    try:
        # a backstop: the OpenAI body the job stands for is checked exactly by parse_body
        check_depth(raw, "input", slack=2)
        shape = model.model_validate(raw)
    except ApiError as e:
        raise refuse(f"input.{e.message}", e.param) from None
    except ValidationError as exc:
        errors = exc.errors()
        loc = errors[0]["loc"]
        raise refuse(_shape_error(model, errors), str(loc[0]) if loc else None) from None
    if isinstance(shape, EngineJob):
        job = _engine_job(shape)
    else:
        job = _openai_job(shape)
        if job.method is not None and job.method not in ("GET", "POST"):
            raise refuse(f"input.method: {job.method[:20]!r} is not one of GET, POST", "method")
    if job.route in (CHAT_ROUTE, COMPLETIONS_ROUTE) and (job.method or "POST") == "POST":
        try:
            parse_body(job.route, job.body)
        except ApiError as e:
            raise job.refusal(e) from None
    return job


def _openai_job(shape: OpenAIJob | RouteJob) -> Job:
    if isinstance(shape, OpenAIJob):
        param, route, body, method = "openai_route", shape.openai_route, shape.openai_input, None
    else:
        param, route, body = "route", shape.route, shape.body
        method = (shape.method or ("POST" if body else "GET")).upper()
    path = canonical_route(route)
    job = Job(shape, path, body or {}, method)
    if path not in ROUTES:
        message = f"input.{param}: unknown route {route[:100]!r}; accepted: {', '.join(ROUTES)}"
        raise JobInputError(message, job.error(ApiError(404, message, param)))
    if method in ("GET", "POST") and method != ROUTE_METHODS[path]:
        hint = "; send a body" if method == "GET" else ""
        raise job.refusal(
            ApiError(
                405,
                f"method: {method} is not allowed on {path} (it answers "
                f"{ROUTE_METHODS[path]}{hint})",
                "method",
            )
        )
    return job


def _engine_job(shape: EngineJob) -> Job:
    """A prompt/messages job -> the chat or completions body it stands for: its sampling_params
    are that body's fields."""
    given = shape.sampling_params
    for key in given:
        if key in ("logprobs", "prompt_logprobs"):
            raise JobInputError(f"input.sampling_params.{key}: {_NO_LOGPROBS}")
        if key not in _JOB_SAMPLING_KEYS:
            raise JobInputError(
                f"input.sampling_params.{key}: unknown field; accepted: "
                f"{', '.join(SAMPLING_FIELDS)}"
            )
    body = {k: v for k, v in given.items() if v is not None}
    for name in ("tools", "tool_choice"):
        if getattr(shape, name) is not None:
            body[name] = getattr(shape, name)
    if shape.use_openai_format:
        body["stream"] = shape.stream
    if shape.messages is not None:
        return Job(shape, CHAT_ROUTE, {**body, "messages": shape.messages})
    if shape.apply_chat_template:
        messages = [{"role": "user", "content": shape.prompt}]
        return Job(shape, CHAT_ROUTE, {**body, "messages": messages}, prompt_as_message=True)
    for name in ("tools", "tool_choice"):
        if name in body:
            where = (
                f"input.{name}"
                if getattr(shape, name) is not None
                else f"input.sampling_params.{name}"
            )
            raise JobInputError(
                f"{where}: tools need a chat request; send messages (or apply_chat_template with "
                "the prompt)"
            )
    return Job(shape, COMPLETIONS_ROUTE, {**body, "prompt": shape.prompt})


@dataclass
class BatchSizes:
    """Stream chunk sizes: start at `minimum` tokens, multiply by `growth` after each chunk, cap at
    `maximum`."""

    minimum: int
    growth: float
    maximum: int

    @classmethod
    def for_job(cls, job: _BatchOverrides, settings) -> "BatchSizes":
        maximum = job.max_batch_size or settings.default_batch_size
        minimum = min(job.min_batch_size or settings.default_min_batch_size, maximum)
        return cls(
            minimum,
            float(job.batch_size_growth_factor or settings.default_batch_size_growth_factor),
            maximum,
        )

    def sizes(self):
        size = self.minimum
        while True:
            yield size
            size = max(size, min(int(size * self.growth), self.maximum))


def _empty_batch(n: int) -> dict:
    return {"choices": [{"tokens": []} for _ in range(n)]}


async def run_engine_job(
    engine, routes, job: Job, settings, request_id: str, on_finish=None
) -> AsyncIterator[dict]:
    """Generate for a prompt/messages job; yield worker-vllm batches
    `{"choices": [{"tokens": [...]}], "usage": ...}`.

    The engine request is the one the OpenAI route builds from the same body (routes.prepare).
    Streaming: each batch holds the text pieces of about `size` new tokens (sizes grow per
    BatchSizes); not streaming: one batch with the whole text per choice. The last batch carries
    each choice's finish_reason. on_finish(prompt_tokens, output_tokens) is called once the request
    is done (admission learns request sizes)."""
    request = await routes.prepare(job.route, job.body)
    stream = _outputs(engine, request_id, request)
    n = request.params.n
    streaming = job.stream
    sizes = BatchSizes.for_job(job.shape, settings).sizes()
    size = next(sizes)
    texts = [""] * n
    counts = [0] * n
    batch, in_batch, last = _empty_batch(n), 0, None
    async with aclosing(stream) as outputs:
        async for out in outputs:
            last = out
            if any(c.finish_reason == "abort" for c in out.outputs):
                raise JobAborted("request aborted")
            if not streaming:
                continue
            for c in out.outputs:
                new_tokens = len(c.token_ids) - counts[c.index]
                if c.text != texts[c.index] or new_tokens:
                    batch["choices"][c.index]["tokens"].append(c.text[len(texts[c.index]) :])
                    texts[c.index], counts[c.index] = c.text, len(c.token_ids)
                    in_batch += max(new_tokens, 0)
            if in_batch >= size and not out.finished:
                batch["usage"] = {"input": len(out.prompt_token_ids), "output": sum(counts)}
                yield batch
                batch, in_batch, size = _empty_batch(n), 0, next(sizes)
    if last is None:
        raise JobAborted("request ended without output")
    total = sum(len(c.token_ids) for c in last.outputs)
    if not streaming:
        for c in last.outputs:
            batch["choices"][c.index]["tokens"] = [c.text]
    for c in last.outputs:
        batch["choices"][c.index]["finish_reason"] = c.finish_reason
    batch["usage"] = {"input": len(last.prompt_token_ids), "output": total}
    if on_finish is not None:
        on_finish(len(last.prompt_token_ids), total)
    yield batch


async def _outputs(engine, request_id: str, request) -> AsyncIterator[Any]:
    """The engine's outputs for a job's request; its refusals name the job's own field."""
    try:
        async with aclosing(engine.generate(request_id, request.prompts[0], request.params)) as out:
            async for item in out:
                yield item
    except ValueError as e:
        raise ValueError(request.engine_error(e).message) from None


async def run_openai_job(routes, job: Job, settings, on_finish=None) -> AsyncIterator[Any]:
    """Dispatch a job answered in OpenAI's shapes. Not streaming: the response object. Streaming:
    batches of chunks, their count growing per BatchSizes, as one string of SSE lines
    (RAW_OPENAI_OUTPUT, ending in `data: [DONE]`) or as a list of chunk objects, as worker-vllm
    streams them."""
    result = await routes.dispatch(job.route, job.body, job.method)
    if isinstance(result, dict):
        usage = result.get("usage")
        if on_finish is not None and isinstance(usage, dict):
            on_finish(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))
        yield result
        return
    raw = settings.raw_openai_output
    sizes = BatchSizes.for_job(job.shape, settings).sizes()
    size = next(sizes)
    batch: list = []
    async with aclosing(result) as chunks:
        async for chunk in chunks:
            batch.append(sse(chunk) if raw else chunk)
            if len(batch) >= size:
                yield "".join(batch) if raw else batch
                batch, size = [], next(sizes)
    if raw:
        batch.append(SSE_DONE)
    if batch:
        yield "".join(batch) if raw else batch


def stream_error_batch(job: Job, error: ApiError, settings) -> str | list | None:
    """The last batch of a streamed OpenAI-shaped job ended early: an error event and
    `data: [DONE]`, as the HTTP server ends such a stream; None for jobs answered otherwise."""
    if not (job.openai_output and job.stream):
        return None
    return sse(error.to_dict()) + SSE_DONE if settings.raw_openai_output else [error.to_dict()]
