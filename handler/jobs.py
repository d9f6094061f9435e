"""RunPod job inputs as worker-vllm accepts them (prompt/messages or openai_route), validated, naming the bad field;
and their outputs: worker-vllm-shaped chunks streamed in batches whose token count grows from the min to the max.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, fields
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from pydantic import model_validator

from engine import SamplingParams
from handler.protocol import ChatMessage, describe_validation_error

OPENAI_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models")
_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


class JobInputError(ValueError):
    """A job input the worker can't serve; the message names the field and what it accepts."""


class JobAborted(RuntimeError):
    """The job's engine request was ended from outside (drain deadline, cancel): the job fails with this message."""


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

    prompt: StrictStr | Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: StrictBool = False
    apply_chat_template: StrictBool = False  # a string prompt becomes one user message
    use_openai_format: StrictBool = False  # accepted for worker-vllm compatibility; openai_route is the way now

    @model_validator(mode="after")
    def _one_input(self) -> "EngineJob":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.apply_chat_template and not isinstance(self.prompt, str) and self.messages is None:
            raise ValueError("apply_chat_template needs a string prompt or messages")
        return self


class OpenAIJob(_BatchOverrides):
    """`{"openai_route": "/v1/chat/completions" | "/v1/completions" | "/v1/models", "openai_input": {...}}`."""

    openai_route: StrictStr
    openai_input: dict[str, Any] = Field(default_factory=dict)


def parse_job(raw: Any) -> EngineJob | OpenAIJob:
    """A job's `input` -> the validated job. Raises JobInputError naming the field ("input.sampling_params" ...)."""
    if not isinstance(raw, dict):
        raise JobInputError(f"input: must be an object, got {type(raw).__name__}")
    model = OpenAIJob if "openai_route" in raw else EngineJob
    try:
        job = model.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors()
        if any(e["type"] == "extra_forbidden" for e in errors):
            bad = next(e for e in errors if e["type"] == "extra_forbidden")["loc"][0]
            allowed = ", ".join(f for f in model.model_fields if f != "use_openai_format")
            raise JobInputError(f"input.{bad}: unknown field; accepted: {allowed}") from None
        if any(e["type"] == "value_error" and not e["loc"] for e in errors):
            msg = next(e for e in errors if e["type"] == "value_error" and not e["loc"])["msg"]
            raise JobInputError(f"input: {msg.removeprefix('Value error, ')}") from None
        raise JobInputError("input." + describe_validation_error(errors)[1]) from None
    if isinstance(job, OpenAIJob):
        job.openai_route = normalise_route(job.openai_route)
    return job


def normalise_route(route: str) -> str:
    """'/openai/v1/chat/completions', 'v1/chat/completions/' -> '/v1/chat/completions'; unknown routes refused."""
    path = "/" + route.strip().strip("/")
    if path.startswith("/openai/"):
        path = path[len("/openai"):]
    if not path.startswith("/v1/"):
        path = "/v1" + path
    if path not in OPENAI_ROUTES:
        raise JobInputError(f"input.openai_route: unknown route {route[:100]!r}; accepted: {', '.join(OPENAI_ROUTES)}")
    return path


def sampling_params(job: EngineJob, default_max_tokens: int | None) -> SamplingParams:
    """The job's sampling_params as engine SamplingParams; max_tokens falls back to DEFAULT_MAX_TOKENS."""
    given = dict(job.sampling_params)
    unknown = [k for k in given if k not in _SAMPLING_FIELDS]
    if unknown:
        raise JobInputError(f"input.sampling_params.{unknown[0]}: unknown field; accepted: {', '.join(_SAMPLING_FIELDS)}")
    if given.get("max_tokens") is None and default_max_tokens is not None:
        given["max_tokens"] = default_max_tokens
    try:
        return SamplingParams(**given)
    except ValueError as exc:  # the engine's message starts with the field name
        raise JobInputError(f"input.sampling_params.{exc}") from None


def chat_messages(job: EngineJob) -> list[dict] | None:
    """The conversation to render with the chat template, or None for a raw prompt."""
    if job.messages is not None:
        out = []
        for m in job.messages:
            msg = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):  # text parts -> one string, as the templates expect
                msg["content"] = "".join(part.text for part in m.content)
            out.append(msg)
        return out
    if job.apply_chat_template:
        return [{"role": "user", "content": job.prompt}]
    return None


@dataclass
class BatchSizes:
    """Stream chunk sizes: start at `minimum` tokens, multiply by `growth` after each chunk, cap at `maximum`."""

    minimum: int
    growth: float
    maximum: int

    @classmethod
    def for_job(cls, job: _BatchOverrides, settings) -> "BatchSizes":
        maximum = job.max_batch_size or settings.default_batch_size
        minimum = min(job.min_batch_size or settings.default_min_batch_size, maximum)
        return cls(minimum, float(job.batch_size_growth_factor or settings.default_batch_size_growth_factor), maximum)

    def sizes(self):
        size = self.minimum
        while True:
            yield size
            size = max(size, min(int(size * self.growth), self.maximum))


def _empty_batch(n: int) -> dict:
    return {"choices": [{"tokens": []} for _ in range(n)]}


async def run_engine_job(engine, job: EngineJob, settings, request_id: str,
                         on_finish=None) -> AsyncIterator[dict]:
    """Generate for a prompt/messages job; yield worker-vllm batches `{"choices": [{"tokens": [...]}], "usage": ...}`.

    Streaming: each batch holds the text pieces of about `size` new tokens (sizes grow per BatchSizes); not streaming:
    one batch with the whole text per choice. The last batch carries each choice's finish_reason.
    on_finish(prompt_tokens, output_tokens) is called once the request is done (admission learns request sizes)."""
    params = sampling_params(job, settings.default_max_tokens)
    messages = chat_messages(job)
    if messages is not None:
        stream = engine.chat(request_id, messages, params)
    else:
        stream = engine.generate(request_id, job.prompt, params)
    n = params.n
    sizes = BatchSizes.for_job(job, settings).sizes()
    size = next(sizes)
    texts = [""] * n
    counts = [0] * n
    batch, in_batch, last = _empty_batch(n), 0, None
    async with aclosing(stream) as outputs:
        async for out in outputs:
            last = out
            if any(c.finish_reason == "abort" for c in out.outputs):
                raise JobAborted("request aborted")
            if not job.stream:
                continue
            for c in out.outputs:
                new_tokens = len(c.token_ids) - counts[c.index]
                if c.text != texts[c.index] or new_tokens:
                    batch["choices"][c.index]["tokens"].append(c.text[len(texts[c.index]):])
                    texts[c.index], counts[c.index] = c.text, len(c.token_ids)
                    in_batch += max(new_tokens, 0)
            if in_batch >= size and not out.finished:
                batch["usage"] = {"input": len(out.prompt_token_ids), "output": sum(counts)}
                yield batch
                batch, in_batch, size = _empty_batch(n), 0, next(sizes)
    if last is None:
        raise JobAborted("request ended without output")
    total = sum(len(c.token_ids) for c in last.outputs)
    if not job.stream:
        for c in last.outputs:
            batch["choices"][c.index]["tokens"] = [c.text]
    for c in last.outputs:
        batch["choices"][c.index]["finish_reason"] = c.finish_reason
    batch["usage"] = {"input": len(last.prompt_token_ids), "output": total}
    if on_finish is not None:
        on_finish(len(last.prompt_token_ids), total)
    yield batch


def sse(chunk: Any) -> str:
    """One server-sent event line as the OpenAI API streams it."""
    return f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk, ensure_ascii=False)}\n\n"


async def run_openai_job(routes, job: OpenAIJob, settings, on_finish=None) -> AsyncIterator[Any]:
    """Dispatch an openai_route job. Not streaming: the response object. Streaming: batches of chunks, their count
    growing per BatchSizes, as one string of SSE lines (RAW_OPENAI_OUTPUT, ending in `data: [DONE]`) or as a list
    of chunk objects, as worker-vllm streams them."""
    result = await routes.dispatch(job.openai_route, job.openai_input)
    if isinstance(result, dict):
        usage = result.get("usage")
        if on_finish is not None and isinstance(usage, dict):
            on_finish(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))
        yield result
        return
    raw = settings.raw_openai_output
    sizes = BatchSizes.for_job(job, settings).sizes()
    size = next(sizes)
    batch: list = []
    async with aclosing(result) as chunks:
        async for chunk in chunks:
            if isinstance(chunk, str) and chunk.strip() in ("[DONE]", "data: [DONE]"):
                continue  # the end marker is ours to add, once
            batch.append(sse(chunk) if raw else chunk)
            if len(batch) >= size:
                yield "".join(batch) if raw else batch
                batch, size = [], next(sizes)
    if raw:
        batch.append(sse("[DONE]"))
    if batch:
        yield "".join(batch) if raw else batch
