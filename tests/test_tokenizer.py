"""Tests for engine/tokenizer.py: encode/decode and chat templates against transformers (the
reference, test-only), and the incremental detokenizer against full decodes, with stop strings.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from tokenizers import (
    Tokenizer as RawTokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer

# --------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(smollm2_dir: str) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def hf(smollm2_dir: str):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_dir)


def hf_render(hf_tok, messages, **kwargs) -> str:
    return hf_tok.apply_chat_template(messages, tokenize=False, **kwargs)


def hf_ids(hf_tok, messages, **kwargs) -> list[int]:
    out = hf_tok.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"]) if not isinstance(out, list) else out


def copy_tokenizer_files(src: str, dest: Path, with_template_file: bool = False) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(src) / name, dest / name)
    if with_template_file:
        shutil.copy(Path(src) / "chat_template.jinja", dest / "chat_template.jinja")
    return dest


TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces   ",
    "tabs\tand\nnewlines\r\n\n\nmany",
    "Ünïcödé façade — naïve café; ß ẞ",
    "中文测试：你好，世界！日本語のテキスト、한국어 텍스트",
    "emoji 🎉🚀 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽",
    "combining e\u0301 and zero\u200bwidth, RTL עברית العربية",
    "code: def f(x):\n    return {'a': [1, 2, 3]}  # ok",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "numbers 1234567890 3.14159 -42 1e-9",
    "\u00a0non-breaking\u3000ideographic space",
]


# --------------------------------------------------------------------------------------------------
# Encode / decode against transformers
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(tok, hf, text, add_special_tokens):
    assert tok.encode(text, add_special_tokens=add_special_tokens) == hf.encode(
        text, add_special_tokens=add_special_tokens
    )


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(tok, hf, text, skip):
    ids = hf.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    if not skip:
        # byte-level BPE round-trips exactly
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_decode_random_ids_matches_transformers(tok, hf):
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        ids += [rng.randrange(17) for _ in range(rng.randrange(3))]  # some special tokens too
        rng.shuffle(ids)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )


def test_special_tokens_and_vocab(tok, hf):
    assert tok.bos_token_id == hf.bos_token_id == 1
    assert tok.eos_token_id == hf.eos_token_id == 2
    assert tok.pad_token_id == hf.pad_token_id
    assert tok.unk_token_id == hf.unk_token_id
    assert tok.vocab_size == len(hf)
    assert set(hf.all_special_ids) <= tok.all_special_ids
    assert tok.all_special_ids == set(range(17))  # every added token SmolLM2 flags special
    for i in (0, 1, 2, 100, 9690, tok.vocab_size - 1):
        assert tok.id_to_token(i) == hf.convert_ids_to_tokens(i)
        assert tok.decode_token(i) == hf.decode([i], skip_special_tokens=False)
    assert tok.decode_token(2) == "<|im_end|>"


def test_special_tokens_as_added_token_dicts(smollm2_dir, tmp_path):
    d = copy_tokenizer_files(smollm2_dir, tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {
        "content": "<|endoftext|>",
        "lstrip": False,
        "rstrip": False,
        "special": True,
    }
    cfg["bos_token"] = None
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer.from_dir(str(d))
    assert t.eos_token_id == 0
    assert t.bos_token_id is None


# --------------------------------------------------------------------------------------------------
# Chat templates: SmolLM2's own
# --------------------------------------------------------------------------------------------------

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "What is the capital of France?"}],
    "with_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime number."},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "Hi! 👋"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Translate 'cat' to Chinese: 猫?"},
        {"role": "assistant", "content": "猫 (māo)."},
        {"role": "user", "content": "  spaces\n\nand newlines  "},
    ],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_matches_transformers(tok, hf, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert ours == hf_render(hf, messages, add_generation_prompt=add_generation_prompt)
    ids = tok.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    assert ids == hf_ids(hf, messages, add_generation_prompt=add_generation_prompt)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == ours.count("<|im_start|>")


def test_default_add_generation_prompt_is_true(tok):
    text = tok.apply_chat_template(CONVERSATIONS["user_only"])
    assert text.endswith("<|im_start|>assistant\n")


def test_text_parts_are_joined_for_string_templates(tok, hf):
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}],
        }
    ]
    joined = [{"role": "user", "content": "first\nsecond"}]
    assert tok.apply_chat_template(parts) == hf_render(hf, joined, add_generation_prompt=True)
    with pytest.raises(ValueError, match="only text content parts"):
        tok.apply_chat_template(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        )


@pytest.mark.parametrize(
    "bad",
    [
        [],
        "hello",
        [{"content": "no role"}],
        [{"role": 3, "content": "x"}],
        [{"role": "user", "content": 42}],
        ["not a dict"],
    ],
)
def test_invalid_messages_raise_value_error(tok, bad):
    with pytest.raises(ValueError):
        tok.apply_chat_template(bad)


# --------------------------------------------------------------------------------------------------
# Chat templates written for these tests, exercising what real templates use (with the long lines
# real templates have: each closes with a noqa for E501)
# --------------------------------------------------------------------------------------------------

# Llama-3.1-like: BOS from the template, a date from strftime_now unless date_string is passed,
# tools as indented JSON, single tool calls (raise_exception otherwise), tool results as ipython
# turns.
LLAMA31_STYLE = r"""{{- bos_token }}
{%- if date_string is not defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none %}
    {{- "Call a function by replying with JSON {\"name\": ..., \"parameters\": {...}}.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in loop_messages %}
    {%- if message.role == 'assistant' and message.tool_calls is defined %}
        {%- if message.tool_calls | length != 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {{- '{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}' }}
        {{- "<|eot_id|>" }}
    {%- elif message.role in ["tool", "ipython"] %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable and message.content is not string %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""  # noqa: E501

# Qwen3-like: tools as compact JSON, a namespace and loop controls to find the last user query,
# reasoning_content kept only after it, enable_thinking=False writing an empty think block.
QWEN3_STYLE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == "user" and message.content is string and not message.content.startswith('<tool_response>') %}
        {%- set ns.last_query = index %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "system" %}
        {%- continue %}
    {%- endif %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "assistant" %}
        {%- set reasoning = message.reasoning_content | default('') %}
        {%- if loop.index0 > ns.last_query and reasoning %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- for tc in message.tool_calls | default([]) %}
            {{- '\n<tool_call>\n{"name": "' + tc.function.name + '", "arguments": ' }}
            {{- tc.function.arguments | tojson(separators=(',', ':'), sort_keys=true) }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\n<tool_response>\n' + content + '\n</tool_response><|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""  # noqa: E501

# Strict roles: rejects unknown roles and non-alternating turns with raise_exception; documents
# rendered if given.
STRICT_ROLES = r"""{%- if documents %}
    {{- '<docs>' }}
    {%- for doc in documents %}[{{ loop.index }}] {{ doc.title }}: {{ doc.text }}
{% endfor %}
    {{- '</docs>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Unknown role: ' + message['role']) }}
    {%- endif %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '[' + message['role'] | upper + '] ' + message['content'] + eos_token }}
{%- endfor %}
{%- if add_generation_prompt %}[ASSISTANT] {{ greeting | default('') }}{% endif %}"""  # noqa: E501

# Reads OpenAI-style content parts by looping over them.
PARTS_TEMPLATE = r"""{%- for message in messages %}<|{{ message.role }}|>
{%- if message.content is string %}{{ message.content }}
{%- else %}{% for part in message.content %}{% if part.type == 'text' %}({{ part.text }}){% endif %}{% endfor %}
{%- endif %}<|end|>
{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"""  # noqa: E501

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city, e.g. <Zürich> & 東京",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "now",
            "description": "Current time",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]

TOOL_CHAT = [
    {"role": "system", "content": "  You call tools.  "},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": {"unit": "celsius", "city": "Zürich"},
                },
            }
        ],
    },
    {"role": "tool", "content": "21°C, sunny ☀"},
    {"role": "user", "content": "Thanks!"},
]


def _both(tok, hf, template, messages, **kwargs) -> tuple[str, str]:
    ours = tok.apply_chat_template(messages, chat_template=template, **kwargs)
    return ours, hf_render(hf, messages, chat_template=template, **kwargs)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_tools", [True, False])
def test_llama31_style_template(tok, hf, add_generation_prompt, with_tools):
    tools = TOOLS if with_tools else None
    ours, ref = _both(
        tok, hf, LLAMA31_STYLE, TOOL_CHAT, tools=tools, add_generation_prompt=add_generation_prompt
    )
    assert ours == ref
    # bos_token came from the tokenizer config
    assert ours.startswith("<|im_start|><|start_header_id|>system")
    if with_tools:
        # indent kept, no HTML escaping
        assert '    "name": "get_weather"' in ours and "<Zürich> & 東京" in ours
    ours, ref = _both(
        tok,
        hf,
        LLAMA31_STYLE,
        TOOL_CHAT,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        date_string="26 Jul 2024",
    )
    assert ours == ref and "Today Date: 26 Jul 2024" in ours


def test_llama31_style_via_from_dir_argument(smollm2_dir, hf, tmp_path):
    template_file = tmp_path / "llama31.jinja"
    template_file.write_text(LLAMA31_STYLE)
    for source in (LLAMA31_STYLE, str(template_file)):
        t = Tokenizer.from_dir(smollm2_dir, chat_template=source)
        assert t.chat_template == LLAMA31_STYLE
        msgs = CONVERSATIONS["multi_turn"]
        assert t.apply_chat_template(msgs, date_string="1 Jan 2025") == hf_render(
            hf,
            msgs,
            chat_template=LLAMA31_STYLE,
            add_generation_prompt=True,
            date_string="1 Jan 2025",
        )
        assert t.encode_chat(msgs, date_string="1 Jan 2025") == hf_ids(
            hf,
            msgs,
            chat_template=LLAMA31_STYLE,
            add_generation_prompt=True,
            date_string="1 Jan 2025",
        )


def test_llama31_style_raise_exception(tok, hf):
    two_calls = TOOL_CHAT[:2] + [
        {"role": "assistant", "tool_calls": [TOOL_CHAT[2]["tool_calls"][0]] * 2}
    ]
    with pytest.raises(ValueError, match="single tool-calls"):
        tok.apply_chat_template(two_calls, chat_template=LLAMA31_STYLE)
    with pytest.raises(Exception, match="single tool-calls"):
        hf_render(hf, two_calls, chat_template=LLAMA31_STYLE)


QWEN_CHAT = [
    {"role": "system", "content": "You are Qwen."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "\n4", "reasoning_content": "\nSimple arithmetic.\n"},
    {"role": "user", "content": "And the weather in Tokyo?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning": "Need a tool.",
        "tool_calls": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": {"city": "東京", "unit": "celsius"},
                },
            }
        ],
    },
    {"role": "tool", "content": '{"temp": 30}'},
]


@pytest.mark.parametrize("enable_thinking", [None, True, False])
@pytest.mark.parametrize("with_tools", [True, False])
def test_qwen3_style_template(tok, hf, enable_thinking, with_tools):
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    tools = TOOLS if with_tools else None
    ours, ref = _both(
        tok, hf, QWEN3_STYLE, QWEN_CHAT, tools=tools, add_generation_prompt=True, **kwargs
    )
    assert ours == ref
    # `reasoning` exposed as reasoning_content, like transformers
    assert "<think>\nNeed a tool.\n</think>" in ours
    assert '{"city":"東京","unit":"celsius"}' in ours
    assert ours.endswith("<think>\n\n</think>\n\n") == (enable_thinking is False)
    if with_tools:
        assert json.dumps(TOOLS[0], ensure_ascii=False) in ours
    assert tok.encode_chat(QWEN_CHAT, tools=tools, chat_template=QWEN3_STYLE, **kwargs) == hf_ids(
        hf, QWEN_CHAT, tools=tools, chat_template=QWEN3_STYLE, add_generation_prompt=True, **kwargs
    )


def test_strict_roles_template_raises_value_error(tok, hf):
    good = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    docs = [{"title": "Doc A", "text": "alpha"}, {"title": "Doc B", "text": "beta ünï"}]
    for kwargs in ({}, {"documents": docs}, {"greeting": "Sure:"}, {"eos_token": "</END>"}):
        ours, ref = _both(tok, hf, STRICT_ROLES, good, add_generation_prompt=True, **kwargs)
        assert ours == ref
    assert "</END>" in tok.apply_chat_template(good, chat_template=STRICT_ROLES, eos_token="</END>")
    with pytest.raises(ValueError, match="Unknown role: wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}], chat_template=STRICT_ROLES)
    with pytest.raises(ValueError, match="must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "x"}] * 2, chat_template=STRICT_ROLES)
    transformers = pytest.importorskip("transformers")
    del transformers
    with pytest.raises(Exception, match="Unknown role: wizard"):
        hf_render(hf, [{"role": "wizard", "content": "x"}], chat_template=STRICT_ROLES)


def test_parts_template_gets_content_parts(tok, hf):
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "look"}, {"type": "text", "text": "here"}],
        },
        {"role": "assistant", "content": "plain string"},
    ]
    ours, ref = _both(tok, hf, PARTS_TEMPLATE, messages, add_generation_prompt=True)
    assert ours == ref and "(look)(here)" in ours


def test_a_template_prepared_ahead_renders_alike_and_a_broken_one_fails_at_render(tok, smollm2_dir):
    """Tokenizer.prepare_chat_templates compiles ahead (the server does while its engine starts):
    the rendering is the same, and a template that does not compile still fails only where it is
    rendered, with the same error."""
    messages = CONVERSATIONS["user_only"]
    before = tok.apply_chat_template(messages, add_generation_prompt=True)
    fresh = Tokenizer.from_dir(smollm2_dir)
    fresh.prepare_chat_templates()
    assert fresh.apply_chat_template(messages, add_generation_prompt=True) == before
    broken = Tokenizer.from_dir(smollm2_dir, chat_template="{% for x in %}")
    broken.prepare_chat_templates()  # does not raise
    with pytest.raises(ValueError, match="does not compile"):
        broken.apply_chat_template(messages)


def test_template_errors_become_value_errors(tok):
    with pytest.raises(ValueError, match="does not compile"):
        tok.apply_chat_template(CONVERSATIONS["user_only"], chat_template="{% for x in %}")
    with pytest.raises(ValueError, match="failed to render"):
        tok.apply_chat_template(
            CONVERSATIONS["user_only"], chat_template="{{ messages[0].content + 1 }}"
        )
    with pytest.raises(ValueError):  # the sandbox refuses to mutate inputs
        tok.apply_chat_template(
            CONVERSATIONS["user_only"], chat_template="{{ messages.append(1) }}"
        )
    with pytest.raises(ValueError):
        tok.apply_chat_template(
            CONVERSATIONS["user_only"], chat_template="{% set ns = namespace(_x=1) %}"
        )


# --------------------------------------------------------------------------------------------------
# Where chat templates come from
# --------------------------------------------------------------------------------------------------


def test_missing_chat_template(smollm2_dir, tmp_path):
    d = copy_tokenizer_files(smollm2_dir, tmp_path / "m")
    t = Tokenizer.from_dir(str(d))
    assert not t.has_chat_template and t.chat_template is None
    with pytest.raises(ValueError, match="model has no chat template; pass chat_template="):
        t.apply_chat_template(CONVERSATIONS["user_only"])
    with pytest.raises(ValueError, match="not found"):
        Tokenizer.from_dir(str(d), chat_template=str(tmp_path / "missing.jinja"))


def test_template_file_takes_precedence_over_config(smollm2_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    d = copy_tokenizer_files(smollm2_dir, tmp_path / "m", with_template_file=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = STRICT_ROLES
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ref = transformers.AutoTokenizer.from_pretrained(str(d))
    t = Tokenizer.from_dir(str(d))
    assert (
        t.chat_template
        == ref.chat_template
        == (Path(smollm2_dir) / "chat_template.jinja").read_text()
    )
    (d / "chat_template.jinja").unlink()
    ref = transformers.AutoTokenizer.from_pretrained(str(d))
    assert Tokenizer.from_dir(str(d)).chat_template == ref.chat_template == STRICT_ROLES


def test_named_templates_in_config(smollm2_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    d = copy_tokenizer_files(smollm2_dir, tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "default", "template": STRICT_ROLES},
        {"name": "tool_use", "template": QWEN3_STYLE},
    ]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ref = transformers.AutoTokenizer.from_pretrained(str(d))
    t = Tokenizer.from_dir(str(d))
    assert t.has_chat_template and t.chat_template == STRICT_ROLES
    msgs = [{"role": "user", "content": "hi"}]
    assert t.apply_chat_template(msgs) == hf_render(ref, msgs, add_generation_prompt=True)
    assert t.apply_chat_template(msgs, tools=TOOLS) == hf_render(
        ref, msgs, tools=TOOLS, add_generation_prompt=True
    )
    assert t.apply_chat_template(msgs, chat_template="tool_use") == hf_render(
        ref, msgs, chat_template="tool_use", add_generation_prompt=True
    )


def test_chat_template_json_fallback(smollm2_dir, tmp_path):
    d = copy_tokenizer_files(smollm2_dir, tmp_path / "m")
    (d / "chat_template.json").write_text(json.dumps({"chat_template": STRICT_ROLES}))
    assert Tokenizer.from_dir(str(d)).chat_template == STRICT_ROLES
    shutil.copy(Path(smollm2_dir) / "chat_template.jinja", d / "chat_template.jinja")
    assert Tokenizer.from_dir(str(d)).chat_template.startswith("{% for message in messages %}")
    assert Tokenizer.from_dir(str(d), chat_template=PARTS_TEMPLATE).chat_template == PARTS_TEMPLATE


# --------------------------------------------------------------------------------------------------
# Incremental detokenizer
# --------------------------------------------------------------------------------------------------


def stream(tok: Tokenizer, ids: list[int], **kwargs) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed ids one by one; return the detokenizer and every intermediate
    output_text(finished=False)."""
    det = IncrementalDetokenizer(tok, **kwargs)
    shown = []
    for i in ids:
        det.add(i)
        shown.append(det.output_text(finished=False))
    return det, shown


def check_stream_equals_decode(tok: Tokenizer, ids: list[int], skip: bool) -> None:
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    for n, i in enumerate(ids, start=1):
        det.add(i)
        assert full.startswith(det.text)
        so_far = tok.decode(ids[:n], skip_special_tokens=skip)
        if not so_far.endswith("\ufffd"):
            assert det.text == so_far  # nothing is held once the text is complete
    assert det.output_text(finished=True) == full
    assert det.num_tokens == len(ids)


def test_stream_random_ids_equals_full_decode(tok):
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 25))]
        if rng.random() < 0.5:
            ids.insert(rng.randrange(len(ids) + 1), rng.randrange(17))
        check_stream_equals_decode(tok, ids, skip=rng.random() < 0.5)


def test_stream_multibyte_text_equals_full_decode(tok):
    rng = random.Random(3)
    pool = [
        "你好，世界",
        "🎉🚀👨‍👩‍👧‍👦",
        "日本語",
        " naïve",
        "한국어",
        "🇫🇷",
        "\n",
        " the",
        "e\u0301",
        "😀😃😄",
    ]
    partial_seen = 0
    for _ in range(100):
        text = "".join(rng.choice(pool) for _ in range(rng.randrange(1, 8)))
        ids = tok.encode(text, add_special_tokens=False)
        partial_seen += sum(tok.decode_token(i).endswith("\ufffd") for i in ids)
        det, shown = stream(tok, ids)
        assert all("\ufffd" not in s for s in shown)  # a split character is never shown half-done
        assert det.output_text(finished=True) == text
        check_stream_equals_decode(tok, ids, skip=True)
    assert partial_seen > 50  # the texts really do split characters across tokens


def test_flush_incomplete_character_at_finish(tok):
    ids = tok.encode("ok 🎉", add_special_tokens=False)
    assert tok.decode(ids[:-1]).endswith("\ufffd")
    det, _ = stream(tok, ids[:-1])
    assert det.output_text(finished=False) == "ok"  # " " + the emoji's first bytes wait
    assert det.output_text(finished=True) == tok.decode(ids[:-1])
    det.add(ids[-1])  # ignored after finish
    assert det.num_tokens == len(ids) - 1


def test_garbage_run_is_not_held_forever(tok):
    ids = [i for i in range(tok.vocab_size) if tok.decode_token(i) == " \ufffd"][
        :1
    ] * 40  # each ends mid-character
    assert ids
    det = IncrementalDetokenizer(tok)
    for n, i in enumerate(ids, start=1):
        det.add(i)
        # at most 8 tokens are ever held
        assert len(det.text) >= len(tok.decode(ids[: max(0, n - 8)]))
    assert det.output_text(finished=True) == tok.decode(ids)


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("<|im_start|>assistant\nHi there<|im_end|>", add_special_tokens=False)
    det, _ = stream(tok, ids)
    assert det.output_text(True) == "assistant\nHi there"
    det, _ = stream(tok, ids, skip_special_tokens=False)
    assert det.output_text(True) == "<|im_start|>assistant\nHi there<|im_end|>"


STOP_TEXT = "The quick brown fox jumps over the lazy dog. 你好世界! The end."


def check_stop_stream(tok, text, stop, include=False, skip=True):
    ids = tok.encode(text, add_special_tokens=False)
    det, shown = stream(
        tok, ids, stop=stop, include_stop_str_in_output=include, skip_special_tokens=skip
    )
    final = det.output_text(finished=True)
    full = tok.decode(ids, skip_special_tokens=skip)
    # The stop string that completes first (then the one starting first) wins, whatever the token
    # boundaries.
    hits = sorted((full.find(s) + len(s), full.find(s), s) for s in stop if s and s in full)
    if hits:
        _, pos, reason = hits[0]
        assert det.stop_reason == reason
        assert final == (full[: pos + len(reason)] if include else full[:pos])
    else:
        assert det.stop_reason is None and final == full
    for s in shown:
        assert final.startswith(s)  # the stream only ever grows, and never shows text after a cut
        if any(stop_str in s for stop_str in stop if stop_str):
            # a stop string shows only in the final text, and only when included
            assert include and s == final
    return det, shown, final


def test_stop_string_spanning_tokens(tok):
    stop = "fox jumps ov"
    ids = tok.encode(STOP_TEXT, add_special_tokens=False)
    assert not any(stop in tok.decode_token(i) for i in ids)  # no single token holds it
    det, shown, final = check_stop_stream(tok, STOP_TEXT, [stop])
    assert final == "The quick brown " and det.stop_reason == stop
    assert det.num_tokens < len(ids)  # adds after the stop are ignored
    n = det.num_tokens
    det.add(ids[-1])
    assert det.num_tokens == n and det.output_text(True) == final


def test_stop_string_included(tok):
    det, shown, final = check_stop_stream(tok, STOP_TEXT, ["lazy d"], include=True)
    assert final == "The quick brown fox jumps over the lazy d"
    assert sum("lazy d" in s for s in shown) == len(shown) - shown.index(final)


def test_stop_string_multibyte_and_first_completed_wins(tok):
    det, _, final = check_stop_stream(tok, STOP_TEXT, ["The end", "世界", "dog. 你"])
    assert det.stop_reason == "dog. 你" and final == "The quick brown fox jumps over the lazy "
    det, _, final = check_stop_stream(tok, STOP_TEXT, ["lazy dog. 你好世界", "dog"])
    assert det.stop_reason == "dog" and final == "The quick brown fox jumps over the lazy "
    # both end together: the earlier start
    det, _, final = check_stop_stream(tok, STOP_TEXT, ["dog", "lazy dog"])
    assert det.stop_reason == "lazy dog" and final == "The quick brown fox jumps over the "


def test_stop_at_start_and_absent(tok):
    det, _, final = check_stop_stream(tok, STOP_TEXT, ["The q"])
    assert final == "" and det.stop_reason == "The q"
    det, shown, final = check_stop_stream(tok, STOP_TEXT, ["not there", "zzz"])
    assert final == STOP_TEXT and det.stop_reason is None
    # max_stop_len - 1 held back
    assert shown[-1] == STOP_TEXT[: len(STOP_TEXT) - (len("not there") - 1)]


def test_stop_strings_random(tok):
    rng = random.Random(11)
    texts = [
        STOP_TEXT,
        "ababababab abc abcd",
        "🎉🎉🎉 party 🎉 time",
        "line1\nline2\n\nline3\n",
        "日本語のテキスト。",
    ]
    for _ in range(200):
        text = rng.choice(texts)
        stops = []
        for _ in range(rng.randrange(1, 4)):
            a = rng.randrange(len(text))
            stops.append(text[a : a + rng.randrange(1, 8)])
        if rng.random() < 0.3:
            stops.append("never-appears")
        check_stop_stream(tok, text, stops, include=rng.random() < 0.5)


@pytest.mark.parametrize("stop", [None, [], [""]])
def test_no_stop_strings_hold_nothing(tok, stop):
    ids = tok.encode(STOP_TEXT, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, stop=stop)
    for n, i in enumerate(ids, start=1):
        det.add(i)
        assert det.output_text(finished=False) == det.text
        if not tok.decode(ids[:n]).endswith("\ufffd"):
            assert det.text == tok.decode(ids[:n])
    assert det.stop_reason is None and det.output_text(finished=True) == STOP_TEXT


def test_stop_string_across_skipped_special_token(tok):
    ids = (
        tok.encode("Hello wor", add_special_tokens=False)
        + [2]
        + tok.encode("ld!", add_special_tokens=False)
    )
    det, _ = stream(tok, ids, stop=["world"])
    assert det.stop_reason == "world" and det.output_text(True) == "Hello "
    det, _ = stream(tok, ids, stop=["world"], skip_special_tokens=False)
    assert det.stop_reason is None and det.output_text(True) == "Hello wor<|im_end|>ld!"


# --------------------------------------------------------------------------------------------------
# A SentencePiece-style tokenizer (byte fallback, "▁" spaces, leading-space strip): Llama 2, Mistral
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sp_tok() -> Tokenizer:
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Hello world, this is a streaming test!",
        "Tokens, bytes and spaces: all of them matter.",
    ] * 20
    raw = RawTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    raw.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
        ),
    )
    spec = json.loads(raw.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # the byte tokens byte fallback needs for characters outside the vocab
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    raw = RawTokenizer.from_str(json.dumps(spec))
    raw.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return Tokenizer(raw, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


def test_sentencepiece_style_stream_equals_full_decode(sp_tok):
    assert sp_tok.decode(sp_tok.encode("Hello 你好 world 🎉!")) == "Hello 你好 world 🎉!"
    rng = random.Random(5)
    pool = [
        "Hello",
        " world",
        " 你好",
        "🎉",
        " the lazy dog",
        ",",
        " streaming",
        "\n",
        "  two spaces",
        "é",
    ]
    for _ in range(200):
        ids: list[int] = []
        for _ in range(rng.randrange(1, 6)):
            ids += sp_tok.encode("".join(rng.choice(pool) for _ in range(rng.randrange(1, 4))))
            if rng.random() < 0.4:
                ids.append(rng.choice([1, 2]))  # <s> / </s> mid-stream
        check_stream_equals_decode(sp_tok, ids, skip=rng.random() < 0.5)


def test_sentencepiece_style_keeps_spaces_after_special_tokens(sp_tok):
    ids = sp_tok.encode("Hello") + [2] + sp_tok.encode("world")  # "▁world" after a skipped </s>
    det, _ = stream(sp_tok, ids)
    assert det.output_text(True) == sp_tok.decode(ids) == "Hello world"
