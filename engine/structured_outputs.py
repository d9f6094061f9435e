"""What a request's output must match (StructuredOutputs, named like vLLM's
StructuredOutputsParams): the spec alone, validated, and its llguidance grammar text. No torch: the
OpenAI front builds and checks it; engine.structured compiles it against the tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar larger than 1 MiB of text is refused
MAX_CHOICES = 1024
# JSON's whitespace between two tokens: up to 32 blanks and line breaks, room for a pretty-printed
# document's newline and indentation. Unbounded whitespace (JSON's own rule) lets a model write
# blanks forever: the grammar would never force the document to end.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,32}"

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"[:200]


@dataclass(frozen=True, eq=False)
class StructuredOutputs:
    """What a request's output must match; exactly one of json (a JSON schema, as a dict or its
    text), regex, choice (the output is one of these strings), grammar (Lark, or llama.cpp's GBNF)
    or json_object (any JSON object). Named like vLLM's StructuredOutputsParams. JSON may hold up to
    32 whitespace characters between two tokens (JSON_WHITESPACE), or none with
    disable_any_whitespace (`{"a":1}`), or what whitespace_pattern (a regex) allows. Invalid values
    raise ValueError naming the field."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    # the grammar applies to the tokens after this one (the end of a reasoning model's thinking);
    # None: from the first token
    start_after_token: int | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs: give exactly one of {', '.join(_KINDS)}; "
                f"got {', '.join(given) if given else 'none'}"
            )
        after = self.start_after_token
        if after is not None and (
            isinstance(after, bool) or not isinstance(after, int) or after < 0
        ):
            raise ValueError(
                "structured_outputs.start_after_token: must be a token id, got " + _describe(after)
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                "structured_outputs.disable_any_whitespace: must be a bool, got "
                + _describe(self.disable_any_whitespace)
            )
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str) or len(self.whitespace_pattern) > 1024:
                raise ValueError(
                    "structured_outputs.whitespace_pattern: must be a regex of at most 1024 "
                    "characters, got " + _describe(self.whitespace_pattern)
                )
            if self.disable_any_whitespace:
                raise ValueError(
                    "structured_outputs.whitespace_pattern: give it or "
                    "disable_any_whitespace, not both"
                )
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json: not valid JSON: {exc}") from None
            else:
                parsed = value
            if not isinstance(parsed, (dict, bool)):
                raise ValueError(
                    "structured_outputs.json: a JSON schema must be an object, got "
                    + _describe(parsed)
                )
            text = json.dumps(parsed, ensure_ascii=False)  # key order kept: it orders the output
        elif kind == "choice":
            if not isinstance(value, (list, tuple)) or not value:
                raise ValueError(
                    "structured_outputs.choice: must be a non-empty list of strings, got "
                    + _describe(value)
                )
            if len(value) > MAX_CHOICES:
                raise ValueError(
                    f"structured_outputs.choice: at most {MAX_CHOICES} strings, got {len(value)}"
                )
            bad = next((c for c in value if not isinstance(c, str) or not c), None)
            if bad is not None:
                raise ValueError(
                    "structured_outputs.choice: each choice must be a non-empty string, "
                    "got " + _describe(bad)
                )
            object.__setattr__(self, "choice", tuple(value))
            text = json.dumps(list(value), ensure_ascii=False)
        elif kind == "json_object":
            if value is not True:
                raise ValueError(
                    "structured_outputs.json_object: must be true, got " + _describe(value)
                )
            text = ""
        else:
            if not isinstance(value, str) or not value:
                raise ValueError(
                    f"structured_outputs.{kind}: must be a non-empty string, got "
                    + _describe(value)
                )
            text = value
        if len(text) > MAX_SPEC_CHARS:
            raise ValueError(
                f"structured_outputs.{kind}: at most {MAX_SPEC_CHARS} characters, got {len(text)}"
            )
        object.__setattr__(self, "_kind", kind)
        object.__setattr__(self, "_text", text)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, StructuredOutputs)
            and other.key == self.key
            and other.start_after_token == self.start_after_token
        )

    def __hash__(self) -> int:
        return hash((self.key, self.start_after_token))

    @property
    def kind(self) -> str:
        """Which of json, regex, choice, grammar, json_object is set."""
        return self._kind  # type: ignore[attr-defined]

    @property
    def key(self) -> str:
        """The compile cache's key: equal for specs that compile to the same grammar."""
        return json.dumps([self.kind, self._json_options(), self._text])  # type: ignore[attr-defined]

    def _json_options(self) -> dict:
        if self.disable_any_whitespace:
            return {"whitespace_flexible": False}
        return {"whitespace_pattern": self.whitespace_pattern or JSON_WHITESPACE}

    def grammar_text(self) -> str:
        """The llguidance grammar for this spec (raises ValueError for a spec it cannot express)."""
        import llguidance

        options = self._json_options()
        kind, text = self.kind, self._text  # type: ignore[attr-defined]
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=options)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                '{"type": "object"}', defaults=options
            )
        if kind == "choice":
            return llguidance.grammar_from("choice", text)
        if kind == "regex":
            return llguidance.grammar_from("regex", text)
        return llguidance.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
