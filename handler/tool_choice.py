"""tool_choice "required" and a named function, enforced by the grammar engine: the JSON schema the
reply must match, and the parser that reads that reply back as calls (so a forced call is always
valid).

"required": the reply is a JSON array of `{"name": ..., "parameters": {...}}`, one of the tools each
(one call at most when parallel_tool_calls is false); a named function: the reply is its arguments
object.
"""

from __future__ import annotations

import json
from typing import Any

from handler.tool_calls import StreamDelta, ToolCall, arguments_text
from handler.tool_parsers import ToolCallParser, ToolCallStream

ANY_OBJECT: dict = {"type": "object"}


def _functions(tools: list[dict]) -> dict[str, dict]:
    """name -> parameters schema of OpenAI-style tools ({"type": "function", "function": {...}})."""
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(
                f'tools[{i}]: expected {{"type": "function", "function": {{"name": ...}}}}'
            )
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters: must be a JSON schema object")
        out[fn["name"]] = params or ANY_OBJECT
    return out


def forced_call_schema(
    tools: list[dict], function_name: str | None = None, parallel_tool_calls: bool = True
) -> dict:
    """The JSON schema a reply must match under tool_choice "required" (function_name None) or a
    named function; ValueError naming tool_choice when the name is not among the tools."""
    functions = _functions(tools)
    if not functions:
        raise ValueError("tool_choice: needs at least one tool in tools")
    if function_name is not None:
        if function_name not in functions:
            raise ValueError(
                f"tool_choice: function {function_name!r} is not among the tools "
                f"({', '.join(functions)})"
            )
        return functions[function_name]
    one_call = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, params in functions.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_call}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


class _ForcedStream(ToolCallStream):
    def __init__(self, function_name: str | None):
        self._name = function_name
        self._text: list[str] = []

    def feed(self, text: str) -> StreamDelta:
        self._text.append(text)
        return StreamDelta()

    def finish(self) -> StreamDelta:
        text = "".join(self._text)
        calls = _read_calls(text, self._name)
        return StreamDelta(tool_calls=calls) if calls else StreamDelta(content=text)


def _read_calls(text: str, function_name: str | None) -> list[ToolCall] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None  # cut short (max_tokens, a stop string): what came is content
    if function_name is not None:
        args = arguments_text(value) if isinstance(value, dict) else None
        return [ToolCall(function_name, args)] if args is not None else None
    if not isinstance(value, list):
        return None
    calls = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = arguments_text(item.get("parameters", {}))
        if args is None:
            return None
        calls.append(ToolCall(item["name"], args))
    return calls or None


class ForcedCallParser(ToolCallParser):
    """Reads a reply written under forced_call_schema back as calls (at the end of the stream)."""

    name = "forced"

    def __init__(self, function_name: str | None = None):
        self.function_name = function_name

    def stream(self) -> ToolCallStream:
        return _ForcedStream(self.function_name)
