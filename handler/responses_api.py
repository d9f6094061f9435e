"""/v1/responses for text, as far as it maps onto a chat completion: the request becomes a chat
body, the chat response (or its chunks) becomes a Response object (or the Responses API's stream
events: response.created ... response.output_text.delta ... response.completed).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from handler.protocol import ApiError, ResponsesRequest, describe_validation_error

# Fields a stateless text server cannot honour, and what to do instead.
_REFUSED = {
    "previous_response_id": "responses are not stored; send the whole conversation as input",
    "conversation": "responses are not stored; send the whole conversation as input",
    "tools": "tools are served on /v1/chat/completions",
    "tool_choice": "tools are served on /v1/chat/completions",
    "background": "responses run in the foreground only",
    "prompt": "stored prompts do not exist here; send input",
}


def parse_request(body: Any) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise ApiError(400, f"body: must be a JSON object, got {type(body).__name__}", "body")
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as e:
        param, message = describe_validation_error(e.errors())
        raise ApiError(400, message, param) from None
    for name, instead in _REFUSED.items():
        if getattr(req, name) not in (None, [], "none"):
            raise ApiError(400, f"{name}: not supported: {instead}", name)
    return req


def chat_body(req: ResponsesRequest) -> dict:
    """The chat completions body a Responses request stands for."""
    messages: list[dict] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        for item in req.input:
            content = item.content
            if not isinstance(content, str):
                content = [{"type": "text", "text": part.text} for part in content]
            messages.append({"role": item.role, "content": content})
    body: dict[str, Any] = {"messages": messages, "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    for name, value in (
        ("model", req.model),
        ("max_tokens", req.max_output_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
        ("reasoning_effort", req.reasoning.effort if req.reasoning else None),
    ):
        if value is not None:
            body[name] = value
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    return body


class ResponseShape:
    """One request's Response object, built up from the chat answer or its chunks."""

    def __init__(self, req: ResponsesRequest, model: str):
        self.req = req
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model = model
        self.text = ""
        self.reasoning = ""

    def response(self, status: str, usage: dict | None = None, reason: str | None = None) -> dict:
        output = []
        if self.reasoning:
            output.append(
                {
                    "type": "reasoning",
                    "id": f"rs_{self.message_id[4:]}",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": self.reasoning}],
                }
            )
        if status != "in_progress":
            output.append(self.message(status))
        incomplete = {"reason": "max_output_tokens"} if reason == "length" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": "incomplete" if incomplete else status,
            "model": self.model,
            "output": output,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": self.req.instructions,
            "max_output_tokens": self.req.max_output_tokens,
            "temperature": self.req.temperature,
            "top_p": self.req.top_p,
            "parallel_tool_calls": False,
            "tool_choice": "none",
            "tools": [],
            "text": {"format": {"type": "text"}},
            "usage": _usage(usage),
            "metadata": self.req.metadata or {},
        }

    def message(self, status: str) -> dict:
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [self.part()],
        }

    def part(self) -> dict:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}


def _usage(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def from_chat(req: ResponsesRequest, chat: dict) -> dict:
    """A whole chat completion as a Response object."""
    shape = ResponseShape(req, chat["model"])
    choice = chat["choices"][0]
    shape.text = choice["message"].get("content") or ""
    shape.reasoning = choice["message"].get("reasoning_content") or ""
    return shape.response("completed", chat["usage"], choice["finish_reason"])


async def events_from_chunks(
    req: ResponsesRequest, model: str, chunks: AsyncIterator[dict]
) -> AsyncIterator[dict]:
    """The Responses API's stream events for a streamed chat completion's chunks (the text; a
    reasoning model's thinking comes as a reasoning item in unstreamed responses only)."""
    shape = ResponseShape(req, model)
    seq = iter(range(1 << 62))

    def event(kind: str, **fields) -> dict:
        return {"type": kind, "sequence_number": next(seq), **fields}

    at = {"output_index": 0, "item_id": shape.message_id}
    yield event("response.created", response=shape.response("in_progress"))
    yield event("response.in_progress", response=shape.response("in_progress"))
    yield event("response.output_item.added", output_index=0, item=shape.message("in_progress"))
    yield event("response.content_part.added", content_index=0, part=shape.part(), **at)
    usage, reason = None, None
    async for chunk in chunks:
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            delta = choice["delta"]
            text = delta.get("content") or ""
            if text:
                shape.text += text
                yield event(
                    "response.output_text.delta", content_index=0, delta=text, logprobs=[], **at
                )
            reason = choice.get("finish_reason") or reason
    yield event("response.output_text.done", content_index=0, text=shape.text, logprobs=[], **at)
    yield event("response.content_part.done", content_index=0, part=shape.part(), **at)
    yield event("response.output_item.done", output_index=0, item=shape.message("completed"))
    yield event("response.completed", response=shape.response("completed", usage, reason))
