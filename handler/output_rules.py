"""What a request asks of its output, read once: the grammar it must match (`response_format`,
vLLM's `structured_outputs` and its `guided_*` aliases, or a forced `tool_choice`), and how the
reply is read back (reasoning split off, tool calls parsed). Both faces' requests pass here through
handler.engine_requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from handler.protocol import ApiError, ChatCompletionRequest, NamedToolChoice, SamplingFields
from handler.reasoning import ReasoningParser
from handler.tool_choice import ForcedCallParser, forced_call_schema
from handler.tool_parsers import ToolCallParser

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclass
class ReplyRules:
    """How one chat request's reply is read: reasoning split off first (parser and the rendered
    prompt it looks at), then tool calls parsed from the rest; either may be None."""

    reasoning: ReasoningParser | None = None
    prompt_text: str = ""
    tools: ToolCallParser | None = None


@dataclass
class ToolSettings:
    """The worker's tool-call settings, resolved for its model: the parser for tool_choice "auto"
    (None: "auto" with tools is refused, naming why)."""

    parser: ToolCallParser | None
    why_no_auto: str = ""


def output_grammar(req: SamplingFields, extra_json: dict | None = None) -> tuple[Any, str | None]:
    """(the StructuredOutputs the request's fields ask for, the field that asked), or (None, None);
    a 400 naming the field when two ask at once or one is invalid. extra_json: a schema a forced
    tool_choice adds."""
    from engine.structured_outputs import StructuredOutputs

    asked: list[tuple[str, dict]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ApiError(
                400,
                "response_format.json_schema.schema: required when type is json_schema",
                "response_format.json_schema.schema",
            )
        asked.append(("response_format", {"json": fmt.json_schema.schema_}))
    if req.structured_outputs is not None:
        fields = req.structured_outputs.model_dump(exclude_none=True, by_alias=True)
        asked.append(("structured_outputs", fields))
    guided = {name[len("guided_") :]: getattr(req, name) for name in _GUIDED}
    guided = {k: v for k, v in guided.items() if v is not None}
    if guided:
        if req.guided_whitespace_pattern is not None:
            guided["whitespace_pattern"] = req.guided_whitespace_pattern
        asked.append((next(f"guided_{k}" for k in guided if k != "whitespace_pattern"), guided))
    if extra_json is not None:
        asked.append(("tool_choice", {"json": extra_json}))
    if not asked:
        return None, None
    if len(asked) > 1:
        names = [name for name, _ in asked]
        raise ApiError(
            400,
            f"{names[1]}: cannot be combined with {names[0]}; give one of them",
            names[1],
        )
    name, fields = asked[0]
    try:
        return StructuredOutputs(**fields), name
    except ValueError as e:
        message = str(e)
        if name != "structured_outputs":
            message = message.replace("structured_outputs", name, 1)
        raise ApiError(400, message, name) from None


def renamed_grammar_error(message: str, field: str | None) -> str:
    """The engine names a grammar it cannot compile `structured_outputs.<kind>`: say instead the
    request field that asked for it."""
    if field and field != "structured_outputs" and message.startswith("structured_outputs."):
        return field + message[message.index(":") :]
    return message


def tool_rules(
    req: ChatCompletionRequest, settings: ToolSettings
) -> tuple[list[dict] | None, dict | None, ToolCallParser | None]:
    """(the tools the template renders, the JSON schema a forced choice adds to the grammar, the
    parser that reads the reply's calls) for a chat request."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice != "none":
            raise ApiError(
                400, "tool_choice: needs tools; send tools or leave it out", "tool_choice"
            )
        return None, None, None
    if choice == "none":
        return tools, None, None  # the template shows the tools; the reply is plain content
    if choice == "auto":
        if settings.parser is None:
            if req.tool_choice is None:  # not asked for: name the field that was sent
                message = (
                    f'tools: tool_choice "auto" (the default with tools) {settings.why_no_auto}'
                )
                raise ApiError(400, message, "tools")
            raise ApiError(400, f'tool_choice: "auto" {settings.why_no_auto}', "tool_choice")
        return tools, None, settings.parser
    name = choice.function.name if isinstance(choice, NamedToolChoice) else None
    try:
        schema = forced_call_schema(tools, name, req.parallel_tool_calls)
    except ValueError as e:
        raise ApiError(400, str(e), "tool_choice") from None
    return tools, schema, ForcedCallParser(name)
