"""Reasoning parsers (handler/reasoning.py): the split of the texts Qwen3 and DeepSeek-R1 models
write, by what the prompt left open, and the stream's split against the whole-text parse at every
split point.

The texts follow the families' templates: Qwen3 writes `<think>\\n...\\n</think>\\n\\n` then the
answer, and with enable_thinking=False its template puts `<think>\\n\\n</think>\\n\\n` into the
prompt; Qwen3.5, the 2507 thinking models and DeepSeek-R1 (and its distills) end the prompt with
`<think>\\n`, so the reply starts inside the thinking and only writes `</think>`.
"""

from __future__ import annotations

import random

import pytest

from handler.reasoning import (
    REASONING_PARSERS,
    ReasoningDelta,
    detect_reasoning_parser,
    prompt_leaves_thinking_open,
    reasoning_parser,
)

QWEN3_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
QWEN3_NO_THINKING = QWEN3_PROMPT + "<think>\n\n</think>\n\n"
OPEN_PROMPT = QWEN3_PROMPT + "<think>\n"
R1_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>\n"

# (parser, prompt, completion, reasoning, content)
CASES = [
    (
        "qwen3",
        QWEN3_PROMPT,
        "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
        "The user greets me.",
        "Hello! How can I help?",
    ),
    ("qwen3", QWEN3_PROMPT, "<think>\n\n</think>\n\nHello!", None, "Hello!"),
    ("qwen3", QWEN3_PROMPT, "  \n<think>\nmulti\n\nline\n\n</think>\n\nA", "multi\n\nline", "A"),
    (
        "qwen3",
        QWEN3_PROMPT,
        "<think>\nstill thinking when max_tokens hit",
        "still thinking when max_tokens hit",
        None,
    ),
    ("qwen3", QWEN3_PROMPT, "No thinking today.", None, "No thinking today."),
    ("qwen3", QWEN3_PROMPT, "Text <think>x</think> y", None, "Text <think>x</think> y"),
    ("qwen3", QWEN3_NO_THINKING, "Hello! <think> is a tag.", None, "Hello! <think> is a tag."),
    ("qwen3", OPEN_PROMPT, "Plan: greet.\n</think>\n\nHello!", "Plan: greet.", "Hello!"),
    ("qwen3", OPEN_PROMPT, "Plan: greet.\n</think>\n\n", "Plan: greet.", None),
    ("qwen3", "", "<think>\na</think>b", "a", "b"),
    (
        "deepseek_r1",
        R1_PROMPT,
        "Okay, the user says hi.\n</think>\n\nHi there!",
        "Okay, the user says hi.",
        "Hi there!",
    ),
    ("deepseek_r1", R1_PROMPT, "<think>\nOkay.\n</think>\n\nHi", "Okay.", "Hi"),
    (
        "deepseek_r1",
        "",
        "Okay, no open tag in this prompt.\n</think>\nHi",
        "Okay, no open tag in this prompt.",
        "Hi",
    ),
    ("deepseek_r1", R1_PROMPT, "Cut short while thinking", "Cut short while thinking", None),
    (
        "deepseek_r1",
        R1_PROMPT + "\n</think>\n\n",
        "Direct answer </think>",
        None,
        "Direct answer </think>",
    ),
    ("deepseek_r1", R1_PROMPT, "a </think> b </think> c", "a ", " b </think> c"),
]


@pytest.mark.parametrize("name, prompt, text, reasoning, content", CASES)
def test_parse_splits_reasoning_from_content(name, prompt, text, reasoning, content):
    assert reasoning_parser(name).parse(text, prompt) == (reasoning, content)


def _stream(name: str, prompt: str, parts: list[str]) -> tuple[str | None, str | None]:
    s = reasoning_parser(name).stream(prompt)
    deltas = [s.feed(p) for p in parts] + [s.finish()]
    return (
        "".join(d.reasoning for d in deltas) or None,
        "".join(d.content for d in deltas) or None,
    )


@pytest.mark.parametrize("name, prompt, text, reasoning, content", CASES)
def test_stream_matches_the_whole_parse_at_every_split(name, prompt, text, reasoning, content):
    whole = reasoning_parser(name).parse(text, prompt)
    for cut in range(len(text) + 1):
        assert _stream(name, prompt, [text[:cut], text[cut:]]) == whole, cut
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        assert (
            _stream(name, prompt, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
            == whole
        )
    assert _stream(name, prompt, list(text)) == whole


def test_reasoning_streams_before_the_thinking_ends():
    s = reasoning_parser("qwen3").stream(QWEN3_PROMPT)
    assert s.feed("<think>\nFirst,") == ReasoningDelta(reasoning="First,")
    assert s.in_reasoning
    # the newline may end the thinking
    assert s.feed(" greet.\n") == ReasoningDelta(reasoning=" greet.")
    assert s.feed("</th") == ReasoningDelta()
    assert s.feed("ink>\n\nHello") == ReasoningDelta(content="Hello")
    assert not s.in_reasoning
    assert s.finish() == ReasoningDelta()


@pytest.mark.parametrize(
    "prompt, expected",
    [
        (OPEN_PROMPT, True),
        (R1_PROMPT, True),
        (QWEN3_NO_THINKING, False),
        (QWEN3_PROMPT, None),
        ("<think>\nold</think>\n\nanswer<|im_end|>\n<|im_start|>assistant\n", False),
    ],
)
def test_prompt_leaves_thinking_open(prompt, expected):
    assert prompt_leaves_thinking_open(prompt) is expected


@pytest.mark.parametrize(
    "template, expected",
    [
        (
            "{%- if enable_thinking is defined and enable_thinking is false %}{{- "
            "'<think>\\n\\n</think>\\n\\n' }}",
            "qwen3",
        ),
        (
            "{{- '<|im_start|>assistant\\n<think>\\n' }}{% set c = "
            "content.split('</think>')[-1] %}",
            "deepseek_r1",
        ),
        (
            "{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}...'</think>'",
            "deepseek_r1",
        ),
        ("{{ message.content }}", None),
        (None, None),
    ],
)
def test_detect_from_template(template, expected):
    assert detect_reasoning_parser(template) == expected


def test_unknown_parser_name_is_refused_with_the_known_ones():
    with pytest.raises(
        ValueError, match="REASONING_PARSER: unknown parser 'granite'; known: qwen3, deepseek_r1"
    ):
        reasoning_parser("granite")
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1"}
