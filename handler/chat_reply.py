"""One chat choice's reply as the OpenAI API shapes it: reasoning split off (`reasoning_content`),
tool calls parsed from the rest (`tool_calls`, finish_reason "tool_calls"), the remaining content;
whole, or as the deltas of a stream, which join into the whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from handler.output_rules import ReplyRules
from handler.tool_calls import ToolCall


@dataclass
class ReplyDelta:
    """What one text delta (or the end) made final, in order: reasoning, content, calls."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ReplyReader:
    """feed() each text delta of one choice, then finish() once; the deltas join into the whole
    reply, however the text is cut."""

    def __init__(self, rules: ReplyRules):
        self._rules = rules
        self._reasoning = rules.reasoning.stream(rules.prompt_text) if rules.reasoning else None
        self._tools = rules.tools.stream() if rules.tools else None
        self.calls: list[dict] = []  # every call sent, as the API shows it (ids fixed once)

    def feed(self, text: str) -> ReplyDelta:
        return self._read(text, last=False)

    def finish(self) -> ReplyDelta:
        return self._read("", last=True)

    def _read(self, text: str, last: bool) -> ReplyDelta:
        out = ReplyDelta()
        content = text
        if self._reasoning is not None:
            split = self._reasoning.finish() if last else self._reasoning.feed(text)
            out.reasoning, content = split.reasoning, split.content
        if self._tools is None:
            out.content = content
            return out
        found = self._tools.feed(content) if content else None
        if found is not None:
            out.content, out.tool_calls = found.content, list(found.tool_calls)
        if last:
            end = self._tools.finish()
            out.content += end.content
            out.tool_calls += end.tool_calls
        return out

    def api_calls(self, calls: list[ToolCall]) -> list[dict]:
        """calls as OpenAI's tool_calls entries, each with a new id and its index in the reply."""
        entries = []
        for call in calls:
            entry = {
                "index": len(self.calls),
                "id": self._rules.tools.new_call_id(),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            self.calls.append(entry)
            entries.append(entry)
        return entries


def whole_reply(rules: ReplyRules, text: str, role: str, finish_reason: str | None) -> tuple:
    """(message, finish_reason) of a whole reply: content, reasoning_content (and vLLM's
    `reasoning`), tool_calls."""
    reader = ReplyReader(rules)
    first, last = reader.feed(text), reader.finish()
    reasoning = first.reasoning + last.reasoning
    content = first.content + last.content
    calls = reader.api_calls(first.tool_calls + last.tool_calls)
    message: dict[str, Any] = {
        "role": role,
        "content": content or (None if calls or reasoning else ""),
    }
    if rules.reasoning is not None:
        message["reasoning_content"] = message["reasoning"] = reasoning or None
    if rules.tools is not None:
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    return message, _finish_reason(finish_reason, bool(calls))


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """A reply that made calls and stopped on its own ends with "tool_calls" (as in vLLM)."""
    return "tool_calls" if called and reason == "stop" else reason


def delta_fields(reader: ReplyReader, delta: ReplyDelta) -> dict:
    """The `delta` object of one streamed chunk."""
    out: dict[str, Any] = {}
    if delta.reasoning:
        out["reasoning_content"] = out["reasoning"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = reader.api_calls(delta.tool_calls)
    return out


def stream_finish_reason(reader: ReplyReader, reason: str | None) -> str | None:
    return _finish_reason(reason, bool(reader.calls))
