"""The test model directories of tests/chat_fixtures.py: the tokenizer loads in the engine, each
template renders as transformers renders it, a call the template writes into the history parses back
into the same call with the format's parser, and the thinking switch leaves the prompt as the
reasoning parser expects.
"""

from __future__ import annotations

import json

import pytest

from engine.tokenizer import Tokenizer
from handler.reasoning import detect_reasoning_parser, prompt_leaves_thinking_open
from handler.tool_calls import ToolCall
from handler.tool_parsers import detect_tool_parser, tool_call_parser
from tests.chat_fixtures import FORMATS, MARKER_TOKENS, SPECIAL_TOKENS, write_chat_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
]
CALLS = [
    ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}'),
    ToolCall("get_time", '{"city": "Tokyo"}'),
]
END_OF_TURN = {"hermes": "<|im_end|>\n", "llama3_json": "<|eot_id|>"}


def conversation(calls: list[ToolCall], content: str | None = None) -> list[dict]:
    """A question, the assistant's calls (OpenAI shape: arguments as JSON text), the results."""
    assistant = {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for i, c in enumerate(calls)
        ],
    }
    results = [
        {"role": "tool", "tool_call_id": f"call_{i}", "content": json.dumps({"ok": i})}
        for i in range(len(calls))
    ]
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and time in Tokyo?"},
        assistant,
        *results,
    ]


@pytest.fixture(scope="module", params=sorted(FORMATS))
def model_dir(request, tmp_path_factory):
    return request.param, write_chat_model(tmp_path_factory.mktemp(request.param), request.param)


def test_tokenizer_loads_with_every_marker_as_one_token(model_dir):
    fmt, path = model_dir
    tok = Tokenizer.from_dir(str(path))
    assert tok.eos_token_id == tok.token_to_id(FORMATS[fmt][1]["eos_token"])
    text = (
        'é ✓ <think>\nhm\n</think>\n\n<tool_call>\n{"name": "get_weather"}\n</tool_call><|im_end|>'
    )
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    # markers are text, control tokens are special
    assert tok.decode(ids) == text.replace("<|im_end|>", "")
    for t in MARKER_TOKENS + SPECIAL_TOKENS:
        assert tok.encode(t, add_special_tokens=False) == [tok.token_to_id(t)]


def test_templates_render_as_transformers_renders_them(model_dir):
    transformers = pytest.importorskip("transformers")
    _, path = model_dir
    ours = Tokenizer.from_dir(str(path))
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    for messages, kwargs in [
        (conversation(CALLS), {}),
        (conversation(CALLS[:1], content="Let me check."), {"enable_thinking": True}),
        (conversation([])[:2], {"enable_thinking": False}),
    ]:
        expected = hf.apply_chat_template(
            messages, tools=TOOLS, tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert ours.apply_chat_template(messages, tools=TOOLS, **kwargs) == expected


@pytest.mark.parametrize(
    "calls, content", [(CALLS, None), (CALLS[:1], None), (CALLS[:1], "Let me check.")]
)
def test_a_call_written_by_the_template_parses_back(model_dir, calls, content):
    fmt, path = model_dir
    if fmt == "llama3_json" and content:
        pytest.skip("Llama 3.1's format has no content beside a call")
    tok = Tokenizer.from_dir(str(path))
    messages = conversation(calls, content)[:3]
    before = tok.apply_chat_template(messages[:2], tools=TOOLS, add_generation_prompt=True)
    after = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=False)
    assert after.startswith(before) and after.endswith(END_OF_TURN[fmt])
    reply = after[len(before) : -len(END_OF_TURN[fmt])]  # what the model writes for that turn
    parsed = tool_call_parser(detect_tool_parser(tok.chat_template)).parse(reply)
    assert parsed.tool_calls == calls and parsed.content == content


def test_the_thinking_switch_sets_where_the_reply_starts(model_dir):
    fmt, path = model_dir
    tok = Tokenizer.from_dir(str(path))
    assert detect_reasoning_parser(tok.chat_template) == "qwen3"
    question = conversation([])[:2]
    on = tok.apply_chat_template(question, enable_thinking=True)
    off = tok.apply_chat_template(question, enable_thinking=False)
    # Qwen3: the model opens <think> itself; off closes an empty one in the prompt
    if fmt == "hermes":
        assert prompt_leaves_thinking_open(on) is None and prompt_leaves_thinking_open(off) is False
    else:  # R1-distilled Llama: the prompt opens <think>
        assert prompt_leaves_thinking_open(on) is True and prompt_leaves_thinking_open(off) is None


@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_engine_runs_the_random_weight_model(tmp_path, fmt):
    pytest.importorskip("transformers")
    from engine import LLM, SamplingParams

    path = write_chat_model(tmp_path / fmt, fmt, weights=True)
    llm = LLM(model=str(path), dtype="float32", device="cpu", max_model_len=128, seed=0)
    out = llm.chat(
        [{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 4
