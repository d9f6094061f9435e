"""Tool-call parsers (handler/tool_parsers.py) against the exact text the model families emit, and
their streams against their own whole-text parse at every split point of each text.

The emitted texts come from the families' published material: Qwen's function-calling guide (the
output of Qwen2.5/Qwen3 for its two-tool example) and Qwen2.5's chat template (content, then calls);
Meta's Llama 3.1 prompt-format guide (the JSON call after `Respond in the format {"name": ...,
"parameters": ...}`) and its <|python_tag|> tool prefix; the Mistral-7B-Instruct-v0.3 example
response (`[TOOL_CALLS] [...]`) and the `name[ARGS]{...}` form of Mistral's later tokenizers.
"""

from __future__ import annotations

import json
import random

import pytest

from handler.tag_stream import Tag, TagSplitter, held_suffix_len
from handler.tool_calls import ParsedOutput, StreamDelta, ToolCall
from handler.tool_parsers import TOOL_CALL_PARSERS, detect_tool_parser, tool_call_parser

SF = "San Francisco, CA, USA"
QWEN_GUIDE_TWO_CALLS = (
    '<tool_call>\n{"name": "get_current_temperature", "arguments": '
    '{"location": "San Francisco, CA, USA"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_temperature_date", "arguments": '
    '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}}\n</tool_call>'
)
TWO_CALLS = [
    ToolCall("get_current_temperature", json.dumps({"location": SF})),
    ToolCall("get_temperature_date", json.dumps({"location": SF, "date": "2024-10-01"})),
]

# (parser, emitted text, expected content, expected calls)
CASES = [
    ("hermes", QWEN_GUIDE_TWO_CALLS, None, TWO_CALLS),
    (
        "hermes",
        'THIS IS CONTENT\n<tool_call>\n{"name": "get_current_temperature", "arguments": '
        '{"location": "Paris, France", "unit": "celsius"}}\n</tool_call>',
        "THIS IS CONTENT",
        [ToolCall("get_current_temperature", '{"location": "Paris, France", "unit": "celsius"}')],
    ),
    # Hermes 2 Pro writes the arguments first
    (
        "hermes",
        '<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": '
        '"get_stock_fundamentals"}\n</tool_call>',
        None,
        [ToolCall("get_stock_fundamentals", '{"symbol": "TSLA"}')],
    ),
    (
        "hermes",
        'Arguments as a string: <tool_call>{"name": "f", "arguments": "{\\"x\\": [1, '
        '2]}"}</tool_call>',
        "Arguments as a string:",
        [ToolCall("f", '{"x": [1, 2]}')],
    ),
    ("hermes", "No tools needed: the answer is 4.", "No tools needed: the answer is 4.", []),
    (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {broken}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {broken}\n</tool_call>',
        [],
    ),
    (
        "hermes",
        'before <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n\n and after  ',
        "before\nand after  ",
        [ToolCall("f", "{}")],
    ),
    (
        "hermes",
        'cut short: <tool_call>\n{"name": "f", "arguments": {"a": 1}}',
        "cut short:",
        [ToolCall("f", '{"a": 1}')],
    ),
    (
        "hermes",
        'cut short: <tool_call>\n{"name": "f", "argu',
        'cut short: <tool_call>\n{"name": "f", "argu',
        [],
    ),
    (
        "hermes",
        "a </tool_call> stray closing tag <tool_ca",
        "a </tool_call> stray closing tag <tool_ca",
        [],
    ),
    (
        "llama3_json",
        '{"name": "get_current_conditions", "parameters": {"location": "Menlo Park, CA", '
        '"unit": "Fahrenheit"}}',
        None,
        [
            ToolCall(
                "get_current_conditions", '{"location": "Menlo Park, CA", "unit": "Fahrenheit"}'
            )
        ],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [ToolCall("get_weather", '{"city": "Paris"}')],
    ),
    (
        "llama3_json",
        '\n{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"n": 1}}',
        None,
        [ToolCall("a", "{}"), ToolCall("b", '{"n": 1}')],
    ),
    (
        "llama3_json",
        "The weather in Menlo Park is sunny.",
        "The weather in Menlo Park is sunny.",
        [],
    ),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    (
        "llama3_json",
        '{"name": "f", "parameters": {"a": 1}} and some words',
        '{"name": "f", "parameters": {"a": 1}} and some words',
        [],
    ),
    (
        "llama3_json",
        '<|python_tag|>brave_search.call(query="weather")',
        '<|python_tag|>brave_search.call(query="weather")',
        [],
    ),
    ("llama3_json", "<|python", "<|python", []),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": '
        '{"location": "San Francisco, CA", "format": "celsius"}}]',
        None,
        [ToolCall("get_current_weather", '{"location": "San Francisco, CA", "format": "celsius"}')],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}, {"name": "noop", '
        '"arguments": {}, '
        '"id": "abcDEF123"}]',
        None,
        [ToolCall("add", '{"a": 3.5, "b": 4}'), ToolCall("noop", "{}")],
    ),
    (
        "mistral",
        'Let me look. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        "Let me look.",
        [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", "{}")],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "w", "arguments": {"city": "Boston"}}]\n\nToday it rains.',
        "Today it rains.",
        [ToolCall("w", '{"city": "Boston"}')],
    ),
    ("mistral", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
    ("mistral", "Plain answer, no tools [TOOL_", "Plain answer, no tools [TOOL_", []),
]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_parse_reads_what_the_family_emits(name, text, content, calls):
    assert tool_call_parser(name).parse(text) == ParsedOutput(content, calls)


def _stream(name: str, parts: list[str]) -> tuple[ParsedOutput, list[StreamDelta]]:
    s = tool_call_parser(name).stream()
    deltas = [s.feed(p) for p in parts] + [s.finish()]
    content = "".join(d.content for d in deltas)
    return ParsedOutput(content or None, [c for d in deltas for c in d.tool_calls]), deltas


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_stream_matches_the_whole_parse_at_every_split(name, text, content, calls):
    whole = tool_call_parser(name).parse(text)
    for cut in range(len(text) + 1):
        assert _stream(name, [text[:cut], text[cut:]])[0] == whole, cut
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _stream(name, parts)[0] == whole, parts
    assert _stream(name, list(text))[0] == whole  # one character at a time


def test_hermes_streams_content_at_once_and_each_call_when_its_block_closes():
    s = tool_call_parser("hermes").stream()
    assert s.feed("I will check both.").content == "I will check both."
    assert s.feed("\n<tool_call>\n") == StreamDelta()  # the newline may sit next to a call: held
    first_close = QWEN_GUIDE_TWO_CALLS.index("</tool_call>") + len("</tool_call>")
    body = QWEN_GUIDE_TWO_CALLS[len("<tool_call>\n") : first_close]
    assert s.feed(body) == StreamDelta(tool_calls=[TWO_CALLS[0]])
    assert s.feed(QWEN_GUIDE_TWO_CALLS[first_close:]) == StreamDelta(tool_calls=[TWO_CALLS[1]])
    assert s.finish() == StreamDelta()


def test_llama3_json_streams_plain_answers_at_once():
    s = tool_call_parser("llama3_json").stream()
    assert s.feed("  ").content == ""
    assert s.feed("The answer").content == "  The answer"
    assert s.feed(" is 4.").content == " is 4."


def test_call_ids_have_the_shape_each_format_needs():
    mistral_id = tool_call_parser("mistral").new_call_id()
    assert len(mistral_id) == 9 and mistral_id.isalnum()  # Mistral's templates refuse any other id
    other = tool_call_parser("hermes").new_call_id()
    assert other.startswith("call_") and other != tool_call_parser("hermes").new_call_id()


def test_unknown_parser_name_is_refused_with_the_known_ones():
    with pytest.raises(
        ValueError,
        match="TOOL_CALL_PARSER: unknown parser 'pythonic'; known: hermes, llama3_json, mistral",
    ):
        tool_call_parser("pythonic")
    assert set(TOOL_CALL_PARSERS) == {"hermes", "llama3_json", "mistral"}


@pytest.mark.parametrize(
    "template, expected",
    [
        ('...<tool_call>\\n{"name": <function-name>...', "hermes"),
        ('{{- "[TOOL_CALLS] [" }}', "mistral"),
        ("<|start_header_id|>...{{- '\"parameters\": ' }}", "llama3_json"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
        (None, None),
    ],
)
def test_detect_from_template(template, expected):
    assert detect_tool_parser(template) == expected


def test_tag_splitter_holds_a_split_tag_and_prefers_the_longer_tag():
    split = TagSplitter(["<a>", "<ab>"])
    assert split.feed("x<a") == ["x"]
    assert split.feed("b>y<") == [Tag("<ab>"), "y"]
    assert split.feed("a>") == [Tag("<a>")]
    assert split.feed("<") == []
    assert split.finish() == ["<"]
    assert held_suffix_len("abc</thi", ["</think>"]) == 5
    assert held_suffix_len("abc", ["</think>"]) == 0
