"""Tool-call parsers for the formats the supported families emit, by worker-vllm's TOOL_CALL_PARSER
names:

- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks (Qwen2.5, Qwen3,
  Hermes);
- llama3_json: the whole reply is `{"name": ..., "parameters": {...}}` (Llama 3.1-3.3), maybe after
  `<|python_tag|>`, several calls separated by `;`;
- mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (Mistral v0.3), or
  `[TOOL_CALLS]name[ARGS]{...}`.

Each parser is a pure parse() of a whole completion and a stream() whose deltas join into that same
parse: a call is sent once it is complete and valid, never retracted. Text that does not form a
valid call stays content, as the model wrote it.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import Any

from handler.tag_stream import Tag, TagSplitter, named_parser
from handler.tool_calls import (
    ContentGate,
    ParsedOutput,
    StreamDelta,
    ToolCall,
    call_from_object,
    random_call_id,
)


class ToolCallStream:
    """The incremental side of a parser: feed() each text delta, then finish() once."""

    def feed(self, text: str) -> StreamDelta:
        raise NotImplementedError

    def finish(self) -> StreamDelta:
        raise NotImplementedError


class _TaggedStream(ToolCallStream):
    """A stream cut at its format's tags: _pieces() takes the pieces, _end() closes what is open."""

    def __init__(self, tags: list[str]) -> None:
        self._split = TagSplitter(tags)
        self._gate = ContentGate()
        self._ws_before = ""  # the whitespace held when a call block opened

    def _pieces(self, pieces: list, out: StreamDelta) -> None:
        raise NotImplementedError

    def _end(self, out: StreamDelta) -> None:
        raise NotImplementedError

    def feed(self, text: str) -> StreamDelta:
        out = StreamDelta()
        self._pieces(self._split.feed(text), out)
        return out

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        self._pieces(self._split.finish(), out)
        self._end(out)
        out.content += self._gate.finish()
        return out


class ToolCallParser:
    """A format's parser; `name` is its TOOL_CALL_PARSER value."""

    name = ""

    def stream(self) -> ToolCallStream:
        raise NotImplementedError

    def parse(self, text: str) -> ParsedOutput:
        """The calls and content of a whole completion (the stream's deltas joined)."""
        s = self.stream()
        delta = s.feed(text).extend(s.finish())
        return ParsedOutput(delta.content or None, delta.tool_calls)

    def new_call_id(self) -> str:
        """An id for a call this format's model made (its template may render it back)."""
        return random_call_id()


# ---- hermes
# ----------------------------------------------------------------------------------------


class _HermesStream(_TaggedStream):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__([self.OPEN, self.CLOSE])
        self._body: list[str] | None = None  # inside a block: its text so far

    def _pieces(self, pieces: list, out: StreamDelta) -> None:
        for piece in pieces:
            if self._body is None:
                if piece == Tag(self.OPEN):
                    self._ws_before = self._gate.held()
                    self._body = []
                else:
                    out.content += self._gate.text(piece.text if isinstance(piece, Tag) else piece)
            elif piece == Tag(self.CLOSE):
                self._close(out, closed=True)
            else:
                self._body.append(piece.text if isinstance(piece, Tag) else piece)

    def _close(self, out: StreamDelta, closed: bool) -> None:
        body = "".join(self._body or [])
        self._body = None
        call = None
        try:
            call = call_from_object(json.loads(body))
        except ValueError:
            pass
        if call is not None:
            self._gate.call()
            out.tool_calls.append(call)
        else:  # not a call: the block is content, as written
            raw = self.OPEN + body + (self.CLOSE if closed else "")
            out.content += self._gate.text(self._ws_before + raw)

    def _end(self, out: StreamDelta) -> None:
        if self._body is not None:  # cut off inside a block: a call only if its JSON is whole
            self._close(out, closed=False)


class HermesToolParser(ToolCallParser):
    name = "hermes"

    def stream(self) -> ToolCallStream:
        return _HermesStream()


# ---- llama3_json
# -----------------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"
_JSON = json.JSONDecoder()


def _json_objects(text: str, separator: str | None = None) -> list[Any] | None:
    """Consecutive JSON values, whitespace (and `separator`) between them; else None."""
    values: list[Any] = []
    i, n = 0, len(text)
    while True:
        while i < n and (text[i].isspace() or (values and text[i] == separator)):
            i += 1
        if i == n:
            return values or None
        try:
            value, i = _JSON.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


class _Llama3JsonStream(ToolCallStream):
    """Undecided until the first visible text: `{` or <|python_tag|> may open calls (then the whole
    reply is held to the end, when it either parses as calls or goes out as content); anything else
    is content."""

    def __init__(self) -> None:
        self._held = ""
        self._mode = "undecided"  # -> "content" | "calls"

    def feed(self, text: str) -> StreamDelta:
        if self._mode == "content":
            return StreamDelta(content=text)
        self._held += text
        if self._mode == "undecided":
            visible = self._held.lstrip()
            if visible.startswith(("{", PYTHON_TAG)):
                self._mode = "calls"
            elif visible and not PYTHON_TAG.startswith(visible):
                self._mode = "content"
                held, self._held = self._held, ""
                return StreamDelta(content=held)
        return StreamDelta()

    def finish(self) -> StreamDelta:
        held, self._held = self._held, ""
        if self._mode == "calls":
            body = held.lstrip()
            body = body[len(PYTHON_TAG) :] if body.startswith(PYTHON_TAG) else body
            objects = _json_objects(body, ";")
            calls = [call_from_object(o, ("parameters", "arguments")) for o in objects or []]
            if calls and all(calls):
                return StreamDelta(tool_calls=calls)
        return StreamDelta(content=held)


class Llama3JsonToolParser(ToolCallParser):
    name = "llama3_json"

    def stream(self) -> ToolCallStream:
        return _Llama3JsonStream()


# ---- mistral
# -----------------------------------------------------------------------------------------

_MISTRAL_NAMED_CALL = re.compile(r"\s*([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]+)?\[ARGS\]")


def _mistral_calls(body: str) -> tuple[list[ToolCall], str] | None:
    """What follows [TOOL_CALLS] -> (the calls, the text after them): a JSON array of calls (v0.3),
    or `name[ARGS]{...}` (later tokenizers; several are joined by further [TOOL_CALLS]). None if it
    is neither."""
    start = len(body) - len(body.lstrip())
    if body.startswith("[", start):
        try:
            value, end = _JSON.raw_decode(body, start)
        except ValueError:
            return None
        calls = (
            [call_from_object(o) for o in value] if isinstance(value, list) and value else [None]
        )
        return (calls, body[end:]) if all(calls) else None  # type: ignore[return-value]
    calls, rest = [], ""
    for part in body.split(_MistralStream.TAG):
        m = _MISTRAL_NAMED_CALL.match(part)
        if m is None or rest.strip():
            return None
        try:
            args, end = _JSON.raw_decode(part, m.end())
        except ValueError:
            return None
        call = call_from_object({"name": m.group(1), "arguments": args})
        if call is None:
            return None
        calls.append(call)
        rest = part[end:]
    return calls, rest


class _MistralStream(_TaggedStream):
    """Content up to [TOOL_CALLS]; everything after it is held to the end and parsed as the calls,
    any text after them being content (or, if it does not parse, all of it is content, the tag
    included)."""

    TAG = "[TOOL_CALLS]"

    def __init__(self) -> None:
        super().__init__([self.TAG])
        self._calls: list[str] | None = None  # after the tag: the raw text

    def _pieces(self, pieces: list, out: StreamDelta) -> None:
        for piece in pieces:
            text = piece.text if isinstance(piece, Tag) else piece
            if self._calls is not None:
                self._calls.append(text)
            elif isinstance(piece, Tag):
                self._ws_before = self._gate.held()
                self._calls = []
            else:
                out.content += self._gate.text(text)

    def _end(self, out: StreamDelta) -> None:
        if self._calls is not None:
            body = "".join(self._calls)
            found = _mistral_calls(body)
            if found:
                self._gate.call()
                out.tool_calls += found[0]
                out.content += self._gate.text(found[1])
            else:
                out.content += self._gate.text(self._ws_before + self.TAG + body)


class MistralToolParser(ToolCallParser):
    """[TOOL_CALLS] is a special token in Mistral's tokenizers: the route must decode with
    skip_special_tokens=False for it to reach the text."""

    name = "mistral"

    def stream(self) -> ToolCallStream:
        return _MistralStream()

    def new_call_id(self) -> str:
        # Mistral's templates refuse any other id: "Tool call IDs should be alphanumeric strings
        # with length 9!"
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


# ---- choosing one
# ------------------------------------------------------------------------------------

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def tool_call_parser(name: str) -> ToolCallParser:
    """The parser a TOOL_CALL_PARSER value names; ValueError listing the known names otherwise."""
    return named_parser(TOOL_CALL_PARSERS, "TOOL_CALL_PARSER", name)


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's own tool-call format calls for; None when it shows none."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if '"parameters": ' in chat_template and "<|start_header_id|>" in chat_template:
        return "llama3_json"
    return None
