"""What a tool-call parser hands the routes: the calls found in a completion, its remaining content,
and for streaming the pieces of both as they become final; plus the whitespace rule shared by every
format.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One function call: its name, and its arguments as JSON object text (OpenAI's `arguments`)."""

    name: str
    arguments: str


@dataclass
class ParsedOutput:
    """A whole completion: content is None when only calls (or nothing but whitespace) remain."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class StreamDelta:
    """What one fed delta (or the end of the stream) made final: content text to send, and the calls
    that were completed, in order. Joined over a stream they equal the parse of the whole text."""

    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def extend(self, other: StreamDelta) -> StreamDelta:
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


def random_call_id(length: int = 24) -> str:
    """A tool call id: `call_` and random letters and digits (the shape OpenAI's ids have)."""
    alphabet = string.ascii_letters + string.digits
    return "call_" + "".join(secrets.choice(alphabet) for _ in range(length))


def arguments_text(value: Any) -> str | None:
    """A call's arguments as JSON object text: a dict is serialized; a string is kept when it
    already holds a JSON object (some models write the arguments that way); anything else is not a
    call's arguments."""
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return None
        return json.dumps(parsed, ensure_ascii=False) if isinstance(parsed, dict) else None
    return None


def call_from_object(obj: Any, argument_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    """{"name": str, <argument key>: object} -> ToolCall; None when obj is not shaped like a call.
    Missing arguments count as {} (a function without parameters); other keys (a call id ...) are
    ignored."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    args = "{}" if key is None else arguments_text(obj[key])
    return None if args is None else ToolCall(obj["name"], args)


class ContentGate:
    """Content text around tool calls: the whitespace around a call (the newlines templates put
    around call blocks) goes; where the call stood between two pieces of text it leaves one newline.
    All other text passes unchanged. Trailing whitespace is held until it is known whether a call
    follows."""

    def __init__(self) -> None:
        self._pending = ""  # whitespace not sent yet
        self._after_call = False
        self._sent = False  # some content went out already

    def text(self, text: str) -> str:
        """Content that arrived; returns what can be sent now."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._after_call = False
            self._pending = "\n" if self._sent else ""
        joined = self._pending + text
        core = joined.rstrip()
        if not core:
            self._pending = joined
            return ""
        self._pending = joined[len(core) :]
        self._sent = True
        return core

    def call(self) -> None:
        """A call came: the whitespace before it goes, and so will the whitespace after it."""
        self._pending = ""
        self._after_call = True

    def held(self) -> str:
        """The whitespace held back (to send with text that turns out not to be a call)."""
        pending, self._pending = self._pending, ""
        return pending

    def finish(self) -> str:
        """The stream ended: what is still held is content."""
        pending = self.held()
        self._sent = self._sent or bool(pending)
        return pending
