"""The official `openai` client against `python -m handler serve` (a subprocess on loopback) with
SmolLM2: outputs equal engine.LLM's for the same prompt and parameters, token for token; streaming,
n, stop, seed, logprobs. Tools refused by name; SIGTERM ending what is left with an error event
after the grace period, then exit 0; a truncated weight file named at start.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from openai import APIError, BadRequestError, InternalServerError, NotFoundError, OpenAI

from engine import LLM, SamplingParams
from tests.serve_process import REPO, ServeProcess

SERVED = "smollm2-test"
MAX_MODEL_LEN = 512
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    proc = ServeProcess(
        {
            "MODEL_NAME": smollm2_dir,
            "OPENAI_SERVED_MODEL_NAME_OVERRIDE": SERVED,
            "MAX_MODEL_LEN": str(MAX_MODEL_LEN),
            "DEVICE": "cpu",
            "LOG_LEVEL": "WARNING",
        }
    )
    yield proc
    # SIGTERM on an idle server drains at once and exits 0 (not by the signal).
    assert proc.stop() == 0, proc.output()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(model=smollm2_dir, max_model_len=MAX_MODEL_LEN, device="cpu", num_kv_blocks=128)


def _ref_chat(llm, messages, **params):
    return llm.chat(messages, SamplingParams(**params))[0]


def _token_texts(llm, ids):
    return [llm.get_tokenizer().decode_token(t) for t in ids]


def test_models_lists_the_served_names(client, smollm2_dir):
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == SERVED and smollm2_dir in ids
    # Any served name is accepted: the override, and the local path (what clients of a baked model
    # send).
    for name in (SERVED, smollm2_dir):
        assert (
            client.chat.completions.create(model=name, messages=QUESTION, max_tokens=1).model
            == name
        )


def test_unknown_model_is_a_404_naming_the_served_names(client):
    with pytest.raises(NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=1)
    assert err.value.body["param"] == "model" and SERVED in err.value.body["message"]


def test_chat_greedy_equals_the_engine_token_for_token(client, llm):
    ref = _ref_chat(llm, QUESTION, temperature=0, max_tokens=12).outputs[0]
    resp = client.chat.completions.create(
        model=SERVED, messages=QUESTION, temperature=0, max_tokens=12, logprobs=True, top_logprobs=0
    )
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text
    assert [c.token for c in choice.logprobs.content] == _token_texts(llm, ref.token_ids)
    assert choice.finish_reason == ref.finish_reason
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.prompt_tokens == len(llm.get_tokenizer().encode_chat(QUESTION))
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")


def test_chat_without_max_tokens_runs_to_eos_not_16_tokens(client, llm):
    messages = [{"role": "user", "content": "Write a haiku about tea."}]
    ref = _ref_chat(llm, messages, temperature=0).outputs[0]
    assert len(ref.token_ids) > 16 and ref.finish_reason == "stop"
    resp = client.chat.completions.create(model=SERVED, messages=messages, temperature=0)
    assert resp.choices[0].message.content == ref.text
    assert (
        resp.usage.completion_tokens == len(ref.token_ids)
        and resp.choices[0].finish_reason == "stop"
    )


def test_chat_stream_equals_the_engine_and_ends_with_usage(server, llm):
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "Name three colors."}]},
    ]
    ref = _ref_chat(llm, messages, temperature=0, max_tokens=10).outputs[0]
    # Through the /openai/v1 prefix, as RunPod's load-balanced endpoints route it.
    prefixed = OpenAI(
        base_url=server.base_url + "/openai/v1", api_key="unused", max_retries=0, timeout=300
    )
    chunks = list(
        prefixed.chat.completions.create(
            model=SERVED,
            messages=messages,
            temperature=0,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(llm.get_tokenizer().encode_chat(messages))
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_greedy_and_stream_equal_the_engine(client, llm):
    prompt = "The three primary colors are"
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    resp = client.completions.create(model=SERVED, prompt=prompt, temperature=0, max_tokens=12)
    assert resp.choices[0].text == ref.text and resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.choices[0].finish_reason == ref.finish_reason
    chunks = list(
        client.completions.create(
            model=SERVED, prompt=prompt, temperature=0, max_tokens=12, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    echoed = client.completions.create(
        model=SERVED, prompt=prompt, temperature=0, max_tokens=12, echo=True
    )
    assert echoed.choices[0].text == prompt + ref.text


def test_completion_batch_of_prompts_and_token_ids(client, llm):
    prompts = ["Once upon a time", "The capital of Italy is"]
    refs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    resp = client.completions.create(model=SERVED, prompt=prompts, temperature=0, max_tokens=6)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [r.outputs[0].text for r in refs]
    ids = llm.get_tokenizer().encode(prompts[1])
    by_ids = client.completions.create(model=SERVED, prompt=ids, temperature=0, max_tokens=6)
    assert by_ids.choices[0].text == refs[1].outputs[0].text


def test_n_and_seed_reproduce_the_engine_samples(client, llm):
    ref = _ref_chat(llm, QUESTION, n=2, temperature=1.0, seed=1234, max_tokens=10)
    kwargs = dict(model=SERVED, messages=QUESTION, n=2, temperature=1.0, seed=1234, max_tokens=10)
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [o.text for o in ref.outputs]
    assert texts == [c.message.content for c in sorted(again.choices, key=lambda c: c.index)]
    assert first.usage.completion_tokens == sum(len(o.token_ids) for o in ref.outputs)
    # Streamed, the two choices interleave and each reassembles to its own text.
    parts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
    assert [parts[0], parts[1]] == texts


def test_stop_strings_end_the_text_like_the_engine(client, llm):
    prompt = "1, 2, 3, 4,"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    stop = free.strip().split(",")[2].strip() if free.count(",") >= 3 else free.strip()[:2]
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop=[stop, "zzz"]))[
        0
    ].outputs[0]
    assert ref.finish_reason == "stop" and stop not in ref.text
    resp = client.completions.create(
        model=SERVED, prompt=prompt, temperature=0, max_tokens=16, stop=[stop, "zzz"]
    )
    assert resp.choices[0].text == ref.text and resp.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=SERVED, prompt=prompt, temperature=0, max_tokens=16, stop=stop, stream=True
        )
    )
    assert streamed == ref.text


def test_logprobs_equal_the_engine(client, llm):
    ref = _ref_chat(llm, QUESTION, temperature=0, max_tokens=5, logprobs=3).outputs[0]
    resp = client.chat.completions.create(
        model=SERVED, messages=QUESTION, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == len(ref.token_ids)
    for entry, token_id, position in zip(content, ref.token_ids, ref.logprobs):
        assert math.isclose(entry.logprob, position[token_id].logprob, abs_tol=1e-4)
        assert len(entry.top_logprobs) == 3
        top = sorted(position.values(), key=lambda lp: lp.rank)[:3]
        assert [t.token for t in entry.top_logprobs] == [lp.decoded_token for lp in top]
        assert all(
            math.isclose(t.logprob, lp.logprob, abs_tol=1e-4)
            for t, lp in zip(entry.top_logprobs, top)
        )
        assert bytes(entry.bytes) == entry.token.encode("utf-8")
    comp = client.completions.create(
        model=SERVED, prompt="Hello, my name is", temperature=0, max_tokens=4, logprobs=2
    )
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text
    assert all(len(t) == 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    assert all(b <= 0 for b in lp.token_logprobs)


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_health_and_metrics(server, client):
    assert httpx.get(server.base_url + "/health").json()["status"] == "ok"
    client.completions.create(model=SERVED, prompt="Hi", max_tokens=2)
    text = httpx.get(server.base_url + "/metrics").text
    assert re.search(
        r'^coldbrew_requests_total\{route="/v1/completions",status="200"\} [1-9]', text, re.M
    )
    assert _metric(text, "coldbrew_generation_tokens_total") >= 2
    assert _metric(text, "coldbrew_time_to_first_token_seconds_count") >= 1
    assert _metric(text, "coldbrew_kv_blocks_total") > 0
    for name in (
        "coldbrew_num_requests_running",
        "coldbrew_num_requests_waiting",
        "coldbrew_kv_blocks_free",
    ):
        _metric(text, name)


def test_a_query_string_does_not_choose_the_route(server):
    # each route's endpoint takes the request alone: a query parameter named like an internal
    # argument reaches no handler (it once chose the route: /v1/models?_route=/tokenize tokenized)
    listed = httpx.get(server.base_url + "/v1/models", params={"_route": "/tokenize"})
    assert listed.status_code == 200, listed.text
    assert listed.json()["object"] == "list"


def test_a_closed_stream_aborts_its_engine_request(server):
    # 64 samples to the context limit ignoring EOS: minutes of CPU work unless the abort really
    # stops it.
    body = {
        "model": SERVED,
        "prompt": "Tell me a very long story about a dragon.",
        "n": 64,
        "ignore_eos": True,
        "temperature": 1.0,
        "stream": True,
    }
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", server.base_url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            events = 0
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    json.loads(line[6:])
                    events += 1
                if events == 2:
                    break  # leave mid-stream: the connection closes
    deadline = time.monotonic() + 60
    # the engine request is aborted and its blocks freed: nothing runs, no block stays in use
    while True:
        text = httpx.get(server.base_url + "/metrics").text
        idle = (
            _metric(text, "coldbrew_num_requests_running") == 0
            and _metric(text, "coldbrew_num_requests_waiting") == 0
            and _metric(text, "coldbrew_kv_blocks_used") == 0
        )
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, text
    assert re.search(
        r'^coldbrew_requests_total\{route="/v1/completions",status="499"\} [1-9]', text, re.M
    )


def test_a_client_leaving_a_non_streaming_request_aborts_it(server):
    body = {"model": SERVED, "messages": QUESTION, "n": 64, "ignore_eos": True, "temperature": 1.0}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(
            server.base_url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=3)
        )
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(server.base_url + "/metrics").text
        left = re.search(
            r'^coldbrew_requests_total\{route="/v1/chat/completions",status="499"\} [1-9]',
            text,
            re.M,
        )
        idle = (
            _metric(text, "coldbrew_num_requests_running") == 0
            and _metric(text, "coldbrew_num_requests_waiting") == 0
            and _metric(text, "coldbrew_kv_blocks_used") == 0
        )
        if (left and idle) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert left and idle, text


ADD = {
    "name": "add",
    "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
}
TOOL = {"type": "function", "function": ADD}
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
CALLING = {"role": "assistant", "content": None, "tool_calls": [CALL]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "2"}
TOOL_CASES = {
    "tools with no parser for this template": (dict(tools=[TOOL]), "tools", "TOOL_CALL_PARSER"),
    "tool_choice auto without tools": (dict(tool_choice="auto"), "tool_choice", "needs tools"),
    "functions (deprecated)": (dict(functions=[ADD]), "functions", "send tools"),
    "a function message": (
        dict(messages=[*QUESTION, {"role": "function", "name": "add", "content": "2"}]),
        "messages[1]",
        "deprecated",
    ),
}


@pytest.mark.parametrize("case", TOOL_CASES)
def test_what_tool_calling_cannot_serve_is_refused_naming_the_field(client, case):
    """SmolLM2's chat template shows no tool-call format: tool_choice "auto" has no parser
    (required and named choices need none: tests/test_agents_api.py)."""
    fields, param, words = TOOL_CASES[case]
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(
            **{"model": SERVED, "messages": QUESTION, "max_tokens": 1, **fields}
        )
    assert err.value.body["param"] == param and words in err.value.body["message"]


def test_a_conversation_with_tool_calls_and_results_is_served(client):
    resp = client.chat.completions.create(
        model=SERVED, messages=[*QUESTION, CALLING, RESULT], max_tokens=2
    )
    assert resp.usage.completion_tokens >= 1


def test_tool_choice_none_without_tools_is_served(client):
    resp = client.chat.completions.create(
        model=SERVED, messages=QUESTION, max_tokens=2, tool_choice="none", tools=[]
    )
    assert resp.choices[0].message.tool_calls is None and resp.usage.completion_tokens >= 1


def test_sigterm_ends_streams_past_the_grace_period_with_an_error_event_then_exits_0(smollm2_dir):
    """In-flight requests get SHUTDOWN_GRACE_S; then a stream gets an error event and [DONE] (the
    official client raises APIError with the server's message), a non-streaming request a 503;
    the process exits 0."""
    proc = ServeProcess(
        {
            "MODEL_NAME": smollm2_dir,
            "MAX_MODEL_LEN": str(MAX_MODEL_LEN),
            "DEVICE": "cpu",
            "LOG_LEVEL": "INFO",
            "SHUTDOWN_GRACE_S": "2",
        }
    )
    client = OpenAI(base_url=proc.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    long = dict(
        model=smollm2_dir,
        messages=QUESTION,
        n=16,
        max_tokens=400,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    outcome: dict = {}

    def whole() -> None:
        try:
            client.chat.completions.create(**long)
        except Exception as e:  # the test reads what the client raised
            outcome["whole"] = e

    try:
        stream = client.chat.completions.create(**long, stream=True)
        first = next(iter(stream))
        waiting = threading.Thread(target=whole)
        waiting.start()
        time.sleep(0.5)  # the non-streaming request is in
        proc.proc.send_signal(signal.SIGTERM)
        chunks = 1
        with pytest.raises(APIError) as err:
            for _ in stream:
                chunks += 1
        waiting.join(60)
        code = proc.proc.wait(60)
    finally:
        proc.stop()
    assert first.choices and chunks > 1  # it went on streaming during the grace period
    assert "shutting down" in err.value.message and "SHUTDOWN_GRACE_S" in err.value.message
    assert err.value.body["code"] == 503
    assert isinstance(outcome.get("whole"), InternalServerError)
    assert outcome["whole"].status_code == 503
    assert code == 0, proc.output()
    assert "Traceback" not in "".join(proc.lines), proc.output()


def test_a_truncated_weight_file_stops_the_start_naming_the_file(smollm2_dir, tmp_path):
    model = tmp_path / "truncated-model"
    shutil.copytree(smollm2_dir, model, ignore=shutil.ignore_patterns("packs"))
    weights = model / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    done = _serve_exit(
        {
            "MODEL_NAME": str(model),
            "DEVICE": "cpu",
            "CACHE_DIR": str(tmp_path / "cache"),
            "LOAD_FORMAT": "safetensors",
        }
    )
    assert done.returncode == 1
    out = done.stdout + done.stderr
    assert str(weights) in out and "truncated or corrupt" in out, out[-3000:]


def _serve_exit(env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MODEL_", "OPENAI_"))}
    return subprocess.run(
        [sys.executable, "-m", "handler", "serve", "--port", "0"],
        env={**clean, **env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_bad_setting_stops_serve_with_a_message_naming_it():
    done = _serve_exit({"BLOCK_SIZE": "3", "HF_TOKEN": "hf_DONOTPRINTME"})
    assert done.returncode == 2
    assert "BLOCK_SIZE" in done.stderr and "power of two" in done.stderr
    assert "hf_DONOTPRINTME" not in done.stderr + done.stdout


def test_a_model_that_fails_to_load_exits_non_zero(tmp_path):
    missing = str(tmp_path / "missing-model")
    done = _serve_exit(
        {
            "MODEL_NAME": missing,
            "CACHE_DIR": str(tmp_path / "cache"),
            "BASE_PATH": str(tmp_path / "volume"),
            "DEVICE": "cpu",
            "HF_TOKEN": "hf_DONOTPRINTME",
        }
    )
    assert done.returncode == 1
    assert missing in done.stderr + done.stdout
    assert "hf_DONOTPRINTME" not in done.stderr + done.stdout


def test_prompt_logprobs_on_both_routes_match_the_engine(client, llm):
    """vLLM's prompt_logprobs: per prompt token, None first, then the token's own logprob and the
    top candidates, as the engine computes them."""
    prompt = "The capital of France is Paris"
    ref = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    resp = client.completions.create(
        model=SERVED, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    got = resp.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(ref.prompt_token_ids) and got[0] is None
    for token, pos, want in zip(ref.prompt_token_ids[1:], got[1:], ref.prompt_logprobs[1:]):
        assert str(token) in pos and len(pos) <= 3
        assert pos[str(token)]["logprob"] == pytest.approx(want[token].logprob, abs=1e-4)
    chat = client.chat.completions.create(
        model=SERVED, messages=QUESTION, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    entries = chat.model_extra["prompt_logprobs"]
    assert entries[0] is None and all(len(e) == 1 for e in entries[1:])
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(
            model=SERVED, messages=QUESTION, stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert err.value.body["param"] == "prompt_logprobs"
