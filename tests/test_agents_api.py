"""What agent frameworks call, against `python -m handler serve` with the official `openai` client
and LangChain's ChatOpenAI: structured outputs, tool calls (required, named, auto), reasoning,
logit_bias, /tokenize, /detokenize, /version and generation_config.json defaults.

The model is a tiny random-weight Qwen3-shaped model with a tokenizer trained here and a Hermes chat
template with Qwen3's thinking switch (tests/chat_fixtures.py): its text is noise, so whatever
structure the answers have comes from the grammar and the parsers, and is checked by references we
did not write (jsonschema, pydantic, LangChain's own tool-call handling).
"""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI
from pydantic import BaseModel, Field

from tests.chat_fixtures import write_chat_model
from tests.serve_process import ServeProcess

pytestmark = pytest.mark.slow

SERVED = "agent-test"
QUESTION = [{"role": "user", "content": "what is the weather in paris today?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
        "qty": {"type": "integer", "minimum": 1, "maximum": 50},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "ship": {
            "type": "object",
            "properties": {
                "zone": {"enum": ["eu", "us"]},
                "floor": {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
            },
            "required": ["zone", "floor"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "qty", "color", "tags", "ship"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = write_chat_model(tmp_path_factory.mktemp("hermes"), "hermes", weights=True)
    # the model's own sampling defaults: greedy unless a request says otherwise
    (out / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    return out


@pytest.fixture(scope="module")
def server(model_dir):
    proc = ServeProcess(
        {
            "MODEL_NAME": str(model_dir),
            "OPENAI_SERVED_MODEL_NAME_OVERRIDE": SERVED,
            "MAX_MODEL_LEN": "2048",
            "DEVICE": "cpu",
            "LOG_LEVEL": "WARNING",
        }
    )
    yield proc
    assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _chat(client, **fields):
    return client.chat.completions.create(model=SERVED, messages=QUESTION, **fields)


def _streamed(client, **fields):
    """The chunks of a streamed chat request, joined per choice: content, reasoning, tool calls (by
    index, arguments concatenated as a client does) and the finish reason."""
    choices: dict[int, dict] = {}
    for chunk in _chat(client, stream=True, **fields):
        for c in chunk.choices:
            got = choices.setdefault(
                c.index, {"content": "", "reasoning": "", "calls": {}, "finish": None}
            )
            got["content"] += c.delta.content or ""
            got["reasoning"] += getattr(c.delta, "reasoning_content", None) or ""
            for call in c.delta.tool_calls or []:
                entry = got["calls"].setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            got["finish"] = c.finish_reason or got["finish"]
    return choices


# ---- structured outputs -----------------------------------------------------------------------


class Ship(BaseModel):
    zone: Literal["eu", "us"]
    floor: int = Field(ge=0, le=9)


class Order(BaseModel):
    id: str = Field(max_length=8)
    qty: int = Field(ge=1, le=50)
    color: Literal["red", "green", "blue"]
    tags: list[str] = Field(max_length=3)
    ship: Ship


def test_openai_parse_with_a_pydantic_model_returns_the_parsed_object(client):
    done = client.chat.completions.parse(
        model=SERVED, messages=QUESTION, response_format=Order, temperature=1.0, seed=3
    )
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Order) and isinstance(parsed.ship, Ship)
    assert done.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_always_yields_a_document_the_schema_accepts(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}}
    fields = dict(response_format=fmt, temperature=1.0, seed=11, n=3, max_tokens=400)
    if stream:
        texts = [c["content"] for c in _streamed(client, **fields).values()]
    else:
        texts = [c.message.content for c in _chat(client, **fields).choices]
    assert len(texts) == 3
    for text in texts:
        jsonschema.validate(json.loads(text), ORDER)


def test_the_same_request_without_a_grammar_is_not_json(client):
    """The model alone writes noise: the structure above is the grammar's."""
    text = _chat(client, temperature=1.0, seed=11, max_tokens=60).choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(text)


@pytest.mark.parametrize(
    "fields, check",
    [
        (
            {"structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}},
            lambda t: re.fullmatch("[a-c]{3}-[0-9]{2}", t),
        ),
        ({"guided_regex": "(yes|no), [0-9]"}, lambda t: re.fullmatch("(yes|no), [0-9]", t)),
        ({"structured_outputs": {"choice": ["paris", "tokyo"]}}, lambda t: t in ("paris", "tokyo")),
        ({"guided_choice": ["sunny", "rain"]}, lambda t: t in ("sunny", "rain")),
        (
            {"guided_json": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}},
            lambda t: isinstance(json.loads(t), list),
        ),
        (
            {"structured_outputs": {"grammar": 'start: "the " ("city" | "time") " is " /[0-9]/'}},
            lambda t: re.fullmatch("the (city|time) is [0-9]", t),
        ),
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ],
)
def test_structured_outputs_and_the_guided_aliases(client, fields, check):
    extra = {k: v for k, v in fields.items() if k != "response_format"}
    resp = _chat(
        client,
        temperature=1.0,
        seed=5,
        max_tokens=200,
        response_format=fields.get("response_format"),
        extra_body=extra,
    )
    text = resp.choices[0].message.content
    assert check(text), text
    assert resp.choices[0].finish_reason == "stop"


def test_a_schema_the_grammar_engine_cannot_enforce_is_refused_naming_it(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"uniqueItems": True}}}
    with pytest.raises(BadRequestError) as err:
        _chat(client, response_format=fmt)
    assert err.value.body["param"] == "response_format" and "uniqueItems" in str(err.value)


# ---- tool calls ---------------------------------------------------------------------------------


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required_always_yields_valid_calls_streamed_or_not(client, parallel):
    fields = dict(
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        temperature=1.0,
        seed=21,
        max_tokens=300,
    )
    whole = _chat(client, **fields).choices[0]
    calls = [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.message.tool_calls
    ]
    _check_calls(calls)
    assert len(calls) == 1 or parallel
    assert whole.finish_reason == "tool_calls"
    assert all(c.id.startswith("call_") and c.type == "function" for c in whole.message.tool_calls)
    streamed = _streamed(client, **fields)[0]
    assert [streamed["calls"][i] for i in sorted(streamed["calls"])] == calls
    assert streamed["finish"] == "tool_calls"


def test_a_named_tool_choice_calls_that_function_with_valid_arguments(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    msg = _chat(client, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=2).choices[0]
    (call,) = msg.message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_time"])


def test_auto_parses_the_hermes_calls_a_model_writes_streamed_or_not(client):
    """tool_choice auto: the Hermes parser (read from the chat template) turns `<tool_call>` blocks
    into tool_calls. The noise model is made to write one, with the tokenizer's own `<tool_call>`
    tokens as a Qwen model writes them, by a Lark grammar in the same request (`<name>` is a token
    the grammar engine keeps apart from text)."""
    call = '{"name": "get_weather", "arguments": {"city": "paris", "unit": "celsius"}}'
    text = f"I will check.\n<tool_call>\n{call}\n</tool_call>"
    lark = (
        f'start: "I will check.\\n" <tool_call> {json.dumps(chr(10) + call + chr(10))} </tool_call>'
    )
    fields = dict(tools=TOOLS, extra_body={"structured_outputs": {"grammar": lark}})
    whole = _chat(client, **fields).choices[0]
    assert whole.message.content == "I will check."
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "paris", "unit": "celsius"}
    assert whole.finish_reason == "tool_calls"
    streamed = _streamed(client, **fields)[0]
    assert streamed["content"] == "I will check."
    assert streamed["calls"] == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    # tool_choice none: the same text stays content
    plain = _chat(client, tool_choice="none", **fields).choices[0]
    assert plain.message.content == text and not plain.message.tool_calls


def test_a_langchain_tool_loop_runs_two_tools_to_a_final_answer(server):
    """LangChain's ChatOpenAI.bind_tools: the calls come back parsed into AIMessage.tool_calls, the
    tools run, their results go back as ToolMessages through the chat template, and the final turn
    answers in text."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    llm = ChatOpenAI(
        model=SERVED,
        base_url=server.base_url + "/v1",
        api_key="unused",
        temperature=1.0,
        max_tokens=200,
        seed=7,
        max_retries=0,
    )
    tools = {"add": add, "multiply": multiply}
    history = [HumanMessage("add 2 and 3, then multiply the sum by 4")]
    results = []
    for name in ("add", "multiply"):
        ai = llm.bind_tools(list(tools.values()), tool_choice=name).invoke(history)
        (call,) = ai.tool_calls
        assert call["name"] == name and set(call["args"]) == {"a", "b"}
        assert all(isinstance(v, int) for v in call["args"].values())
        result = tools[name].invoke(call)
        assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
        results.append(result.content)
        history += [ai, result]
    final = llm.bind_tools(list(tools.values()), tool_choice="none").invoke(history)
    assert isinstance(final.content, str) and not final.tool_calls
    # the tools' results reached the prompt of the last turn, rendered by the template
    prompt = httpx.post(
        server.base_url + "/tokenize",
        json={"messages": _as_openai(history), "return_token_strs": False},
        timeout=60,
    ).json()
    text = httpx.post(
        server.base_url + "/detokenize", json={"tokens": prompt["tokens"]}, timeout=60
    ).json()["prompt"]
    for content in results:
        assert f"<tool_response>\n{content}\n</tool_response>" in text


def _as_openai(messages) -> list[dict]:
    from langchain_openai.chat_models.base import _convert_message_to_dict

    return [_convert_message_to_dict(m) for m in messages]


# ---- reasoning -----------------------------------------------------------------------------------


def test_thinking_goes_to_reasoning_content_and_stays_out_of_content(client, server):
    """The template has Qwen3's thinking switch (the qwen3 parser is read from it): a reply that
    continues an open <think> is reasoning up to </think>, then content; cut short, all of it is
    reasoning, exactly the text the model wrote; streamed deltas join into the same split.
    enable_thinking false, or reasoning_effort none, leaves no reasoning."""
    opened = [*QUESTION, {"role": "assistant", "content": "<think>\nthe user wants"}]
    continued = dict(add_generation_prompt=False, continue_final_message=True)
    sampling = dict(max_tokens=40, temperature=1.0, seed=4)
    msg = (
        client.chat.completions.create(
            model=SERVED, messages=opened, extra_body=continued, **sampling
        )
        .choices[0]
        .message
    )
    prompt = httpx.post(
        server.base_url + "/tokenize", json={"messages": opened, **continued}, timeout=60
    ).json()["tokens"]
    raw = client.completions.create(model=SERVED, prompt=prompt, **sampling).choices[0].text
    assert "</think>" not in raw
    assert msg.reasoning_content == raw.lstrip("\n") and msg.content is None
    chunks = client.chat.completions.create(
        model=SERVED, messages=opened, extra_body=continued, stream=True, **sampling
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == raw.lstrip("\n")
    assert not "".join(d.content or "" for d in deltas)
    for extra in (
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"reasoning_effort": "none"},
    ):
        off = _chat(client, max_tokens=10, extra_body=extra).choices[0].message
        assert getattr(off, "reasoning_content", None) is None and off.content is not None


# ---- the rest of the surface -------------------------------------------------------------------


def test_logit_bias_of_100_makes_a_token_the_first(client, server):
    token = httpx.post(server.base_url + "/tokenize", json={"prompt": "paris"}, timeout=60).json()
    target = token["tokens"][-1]
    for seed in range(3):
        resp = _chat(
            client, logit_bias={str(target): 100}, max_tokens=1, temperature=1.0, seed=seed
        )
        assert resp.choices[0].message.content == "paris"


def test_tokenize_then_detokenize_round_trips(server):
    text = "the weather in tokyo is nine degrees"
    got = httpx.post(
        server.base_url + "/tokenize",
        json={"prompt": text, "return_token_strs": True},
        timeout=60,
    ).json()
    assert (
        got["count"] == len(got["tokens"]) == len(got["token_strs"])
        and got["max_model_len"] == 2048
    )
    back = httpx.post(server.base_url + "/detokenize", json={"tokens": got["tokens"]}, timeout=60)
    assert back.json() == {"prompt": text}
    bad = httpx.post(server.base_url + "/detokenize", json={"tokens": [10**6]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    version = httpx.get(server.base_url + "/version", timeout=60).json()["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", version)


def test_generation_config_defaults_apply_when_a_request_leaves_them_unset(client):
    """generation_config.json says temperature 0: two requests without one agree; with one, the
    request's own value wins."""
    a, b = (_chat(client, max_tokens=12).choices[0].message.content for _ in range(2))
    assert a == b
    sampled = {
        _chat(client, max_tokens=12, temperature=1.0, seed=s).choices[0].message.content
        for s in range(3)
    }
    assert len(sampled) > 1


def test_responses_api_text_whole_and_streamed(client):
    """/v1/responses as the openai client calls it: instructions and input become a chat, the
    answer an output_text; streamed, the events' deltas join into the same text."""
    fields = dict(
        model=SERVED,
        instructions="answer briefly",
        input=[{"role": "user", "content": "what is the weather in paris today?"}],
        max_output_tokens=12,
        temperature=1.0,
    )
    whole = client.responses.create(**fields)
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.usage.output_tokens <= 12 and whole.id.startswith("resp_")
    kinds, deltas, done = [], [], None
    for ev in client.responses.create(stream=True, **fields):
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        if ev.type == "response.completed":
            done = ev.response
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "".join(deltas) == done.output_text and done.usage.total_tokens > 0
    fmt = {"format": {"type": "json_schema", "name": "order", "schema": ORDER}}
    doc = client.responses.create(
        model=SERVED, input="an order", text=fmt, temperature=1.0, max_output_tokens=400
    )
    jsonschema.validate(json.loads(doc.output_text), ORDER)
    with pytest.raises(BadRequestError) as err:
        client.responses.create(model=SERVED, input="hi", previous_response_id="resp_1")
    assert err.value.body["param"] == "previous_response_id"


def test_the_end_of_sequence_token_is_not_text_even_with_special_tokens_kept(client):
    """skip_special_tokens false (how Mistral's [TOOL_CALLS] replies are read): the reply's text
    still ends before the end-of-sequence token that ended it, as in vLLM."""
    extra = {"structured_outputs": {"choice": ["paris"]}, "skip_special_tokens": False}
    resp = _chat(client, extra_body=extra)
    assert resp.choices[0].message.content == "paris"
    assert resp.choices[0].finish_reason == "stop"
