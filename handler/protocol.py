"""OpenAI request schemas as pydantic models: what the OpenAI API, its official clients and
worker-vllm users send.

Strict types (a string is never read as a number), bounds that name the field, and clear refusals
for what we lack.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

from handler.limits import (
    MAX_BATCH_PROMPTS,
    MAX_MESSAGES,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKENS_LIMIT,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
)

Number = StrictFloat | StrictInt
RepetitionPenalty = Annotated[Number, Field(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)]
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)]


class _Model(BaseModel):
    # Unknown fields are ignored (clients send vendor extras such as "user" or "store"), types are
    # strict.
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Model):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class JsonSchemaFormat(_Model):
    """response_format.json_schema as OpenAI defines it."""

    name: Annotated[StrictStr, Field(max_length=64)] = "response"
    description: StrictStr | None = None
    # "schema" is a pydantic BaseModel attribute: the field is schema_ here, "schema" in JSON
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Model):
    """vLLM's structured_outputs request field (its StructuredOutputsParams): exactly one of json,
    regex, choice, grammar, json_object (the engine checks that)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False
    whitespace_pattern: StrictStr | None = None


class FunctionDefinition(_Model):
    name: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Model):
    name: StrictStr


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


class TextPart(_Model):
    type: Literal["text"]
    text: StrictStr


class OtherPart(_Model):
    """Any non-text part (image_url, input_audio, file, ...): parsed only to refuse it with a clear
    message."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: StrictStr

    @model_validator(mode="after")
    def _refuse(self) -> "OtherPart":
        if self.type == "text":
            raise ValueError("a text part needs a string 'text'")
        raise ValueError(
            f"content parts of type {self.type!r} are not supported (this model reads text only)"
        )


class ChatMessage(_Model):
    # tool_calls, tool_call_id, reasoning ... reach the template
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: StrictStr | list[TextPart | OtherPart] | None = None
    name: StrictStr | None = None


class SamplingFields(_Model):
    """The fields chat and completions requests share."""

    model: StrictStr | None = None  # None: the served model
    max_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stop: (
        Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS)]
        | Annotated[
            list[Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
            Field(max_length=MAX_STOP_STRINGS),
        ]
        | None
    ) = None
    stop_token_ids: TokenIds | None = None
    seed: StrictInt | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0, le=MAX_TOKENS_LIMIT)] = 0
    # vLLM's: the top logprobs of each prompt token, in the response's prompt_logprobs
    prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    logit_bias: dict[str, Number] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: StrictStr | None = None
    # vLLM's structured outputs, and the guided_* aliases its older releases (and worker-vllm's
    # users) send.
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None
    use_beam_search: StrictBool = False


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # the deprecated forms of tools and tool_choice: refused with what to send instead
    functions: Any = None
    function_call: Any = None


class CompletionRequest(SamplingFields):
    prompt: (
        StrictStr
        | Annotated[list[StrictInt], Field(min_length=1)]
        | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)]
        | Annotated[
            list[Annotated[list[StrictInt], Field(min_length=1)]],
            Field(min_length=1, max_length=MAX_BATCH_PROMPTS),
        ]
    )
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None


class InputText(_Model):
    type: Literal["input_text", "output_text", "text"]
    text: StrictStr


class InputItem(_Model):
    """A message of the Responses API's input list (the only item kind served: function calls,
    their outputs, images and files are refused, naming the item)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[InputText]
    id: StrictStr | None = None
    status: StrictStr | None = None


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[StrictStr, Field(max_length=64)] = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None
    description: StrictStr | None = None


class TextOptions(_Model):
    format: TextFormat | None = None


class ReasoningOptions(_Model):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class ResponsesRequest(_Model):
    """/v1/responses, text only, as far as it maps onto a chat completion."""

    model: StrictStr | None = None
    input: StrictStr | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: StrictStr | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    stream: StrictBool = False
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    user: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None
    # what a stateless text server cannot honour: refused by name
    previous_response_id: Any = None
    tools: Any = None
    tool_choice: Any = None
    background: Any = None
    conversation: Any = None
    prompt: Any = None


class TokenizeRequest(_Model):
    """vLLM's /tokenize: a prompt, or messages rendered through the chat template."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = (
        None
    )
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Model):
    model: StrictStr | None = None
    tokens: Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(max_length=MAX_TOKENS_LIMIT)]


# ---- errors ---------------------------------------------------------------------------------

_ERROR_TYPES = {404: "not_found_error", 503: "service_unavailable"}


class ApiError(Exception):
    """An error the caller caused (4xx) or one of ours (5xx), shaped like OpenAI's error body."""

    def __init__(
        self, status: int, message: str, param: str | None = None, type: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        default = "invalid_request_error" if status < 500 else "server_error"
        self.type = type or _ERROR_TYPES.get(status, default)

    def to_dict(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


# ---- validation errors -> one message naming the field -------------------------------------------

# Fields whose type is a union: what they accept, in words (pydantic would list each alternative's
# failure).
_UNION_WORDS = {
    "stop": f"a string or a list of at most {MAX_STOP_STRINGS} strings",
    "prompt": "a string, a list of token ids, a list of strings or a list of token-id lists",
    "content": "a string, a list of text parts ({'type': 'text', 'text': ...}) or null",
}
_TYPE_WORDS = {
    "string_type": "a string",
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "int_from_float": "an integer",
    "none_required": "null",
}
_RANK = {"value_error": 0, "missing": 2}


def _is_union_tag(part: Any) -> bool:
    """pydantic names the alternative of a union it tried in the error location: 'str', 'list[int]',
    'TextPart'..."""
    return isinstance(part, str) and (
        any(c in part for c in "[]-(")
        or part in ("str", "int", "float", "bool")
        or part[:1].isupper()
    )


def field_path(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content' (union alternatives dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_union_tag(part):
            out += f".{part}" if out else str(part)
    return out


def _shown(value: Any) -> str:
    text = repr(value)
    return (
        text
        if len(text) <= 60
        else f"a {type(value).__name__} of length {len(value)}"
        if hasattr(value, "__len__")
        else type(value).__name__
    )


def describe_validation_error(errors: list[dict]) -> tuple[str, str]:
    """pydantic's error list -> (param, message): the most telling error, named by its field
    path."""

    def rank(err: dict) -> tuple:
        kind = err["type"]
        r = _RANK.get(kind, 3 if kind.endswith("_type") or kind in _TYPE_WORDS else 1)
        return (r, -len(err["loc"]))

    best = min(errors, key=rank)
    path = field_path(best["loc"]) or "body"
    kind = best["type"]
    if kind.endswith("_type") or kind in _TYPE_WORDS:  # a wrong type: say what the field accepts
        types = [e for e in errors if e["type"].endswith("_type") or e["type"] in _TYPE_WORDS]
        deepest = max(len(e["loc"]) for e in types)
        paths = {field_path(e["loc"]) for e in types if len(e["loc"]) == deepest}
        if len(paths) > 1:  # several alternatives fail equally deep: name the union field itself
            best = min(types, key=lambda e: len(e["loc"]))
            path = field_path(best["loc"]) or "body"
        same = [e for e in errors if field_path(e["loc"]) == path]
        last = path.rsplit(".", 1)[-1].split("[")[0]
        words = _UNION_WORDS.get(last) if len(same) > 1 or len(paths) > 1 else None
        if words is None:
            kinds = list(dict.fromkeys(_TYPE_WORDS.get(e["type"], e["type"]) for e in same))
            if "a number" in kinds and "an integer" in kinds:
                kinds.remove("an integer")
            words = " or ".join(kinds)
        value = best.get("input")
        return (
            path,
            f"{path}: must be {words}, got {'null' if value is None else type(value).__name__}",
        )
    msg = best["msg"].removeprefix("Value error, ")
    if kind == "missing":
        return path, f"{path}: field required"
    shown = "input" in best and kind not in ("value_error", "too_long", "too_short")
    got = f", got {_shown(best['input'])}" if shown else ""
    return path, f"{path}: {msg}{got}"
