"""Malformed and hostile requests against one `python -m handler serve` process: each gets a precise OpenAI-shaped
4xx naming the field at fault, and a normal request right after it still succeeds.
"""
from __future__ import annotations

import json

import httpx
import pytest

from tests.serve_process import ServeProcess

MAX_MODEL_LEN = 512
MAX_REQUEST_BYTES = 16 << 20
HI = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return {"messages": HI, "max_tokens": 2, **fields}


def completion(**fields):
    return {"prompt": "hi", "max_tokens": 2, **fields}


C, P = "/v1/chat/completions", "/v1/completions"
# (case id, method, path, body: a dict sent as JSON or raw bytes, status, param, words the message must contain)
CASES = [
    ("missing messages", "POST", C, {"max_tokens": 2}, 400, "messages", ["messages", "required"]),
    ("messages not a list", "POST", C, {"messages": "hi"}, 400, "messages", ["messages", "list"]),
    ("empty messages", "POST", C, {"messages": []}, 400, "messages", ["messages", "at least 1"]),
    ("message without role", "POST", C, {"messages": [{"content": "hi"}]}, 400, "messages[0].role", ["required"]),
    ("unknown role", "POST", C, {"messages": [{"role": "bot", "content": "hi"}]}, 400, "messages[0].role",
     ["'user'"]),
    ("content a number", "POST", C, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content",
     ["string", "text parts", "int"]),
    ("image content part", "POST", C, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages[0].content[0]",
     ["image_url", "not supported"]),
    ("max_tokens a string", "POST", C, chat(max_tokens="5"), 400, "max_tokens", ["integer", "str"]),
    ("max_tokens negative", "POST", C, chat(max_tokens=-1), 400, "max_tokens", ["greater than or equal to 1"]),
    ("max_tokens huge", "POST", P, completion(max_tokens=10**12), 400, "max_tokens", ["less than or equal"]),
    ("max_tokens over the context", "POST", P, completion(max_tokens=100_000), 400, "max_tokens",
     ["100000", str(MAX_MODEL_LEN)]),
    ("max_completion_tokens over the context", "POST", C, {"messages": HI, "max_completion_tokens": 5000}, 400,
     "max_completion_tokens", ["5000", str(MAX_MODEL_LEN)]),
    ("n zero", "POST", C, chat(n=0), 400, "n", ["greater than or equal to 1"]),
    ("n huge", "POST", P, completion(n=100_000), 400, "n", ["less than or equal to 128"]),
    ("temperature negative", "POST", C, chat(temperature=-1), 400, "temperature", ["greater than or equal to 0"]),
    ("temperature a string", "POST", C, chat(temperature="hot"), 400, "temperature", ["number", "str"]),
    ("top_p zero", "POST", P, completion(top_p=0), 400, "top_p", ["greater than 0"]),
    ("top_k below -1", "POST", P, completion(top_k=-5), 400, "top_k", ["greater than or equal to -1"]),
    ("presence_penalty out of range", "POST", C, chat(presence_penalty=5), 400, "presence_penalty", ["2"]),
    ("stop list of 10,000 strings", "POST", C, chat(stop=[f"s{i}" for i in range(10_000)]), 400, "stop",
     ["at most 64", "10000"]),
    ("stop a number", "POST", P, completion(stop=7), 400, "stop", ["string", "list"]),
    ("stop string too long", "POST", P, completion(stop="x" * 5000), 400, "stop", ["1024"]),
    ("seed a string", "POST", P, completion(seed="abc"), 400, "seed", ["integer"]),
    ("stream not a bool", "POST", C, chat(stream="yes"), 400, "stream", ["boolean"]),
    ("stream_options without stream", "POST", C, chat(stream_options={"include_usage": True}), 400,
     "stream_options", ["stream"]),
    ("min_tokens over max_tokens", "POST", P, completion(min_tokens=5, max_tokens=2), 400, "min_tokens",
     ["max_tokens", "5"]),
    ("top_logprobs too many", "POST", C, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs", ["20"]),
    ("completion logprobs too many", "POST", P, completion(logprobs=100), 400, "logprobs", ["20"]),
    ("json response_format", "POST", C, chat(response_format={"type": "json_object"}), 400, "response_format",
     ["json_object", "not supported"]),
    ("guided_json", "POST", C, chat(guided_json={"type": "object"}), 400, "guided_json", ["not supported"]),
    ("logit_bias", "POST", P, completion(logit_bias={"50256": -100}), 400, "logit_bias", ["not supported"]),
    ("unknown model", "POST", C, chat(model="gpt-4o"), 404, "model", ["gpt-4o", "smollm2-hostile"]),
    ("unknown route", "POST", "/v1/engines/davinci/completions", completion(), 404, None, ["/v1/completions"]),
    ("wrong method", "GET", C, None, 405, None, ["GET"]),
    ("10 MB prompt", "POST", P, completion(prompt="a" * (10 << 20)), 400, "prompt",
     [str(10 << 20), str(MAX_MODEL_LEN)]),
    ("prompt over the context", "POST", P, completion(prompt="hello " * 600), 400, "prompt",
     ["tokens exceed the context limit", str(MAX_MODEL_LEN)]),
    ("messages over the context", "POST", C, {"messages": [{"role": "user", "content": "hello " * 600}]}, 400,
     "messages", [str(MAX_MODEL_LEN)]),
    ("empty prompt", "POST", P, completion(prompt=""), 400, "prompt", ["empty"]),
    ("token id out of vocabulary", "POST", P, completion(prompt=[1, 2, 10**9]), 400, "prompt",
     ["1000000000", "49152"]),
    ("prompt list of mixed types", "POST", P, completion(prompt=["a", 1]), 400, "prompt", ["list"]),
    ("prompt missing", "POST", P, {"max_tokens": 2}, 400, "prompt", ["required"]),
    ("too many choices", "POST", P, completion(prompt=["hi"] * 20, n=100), 400, "n", ["2000", "1024"]),
    ("lone surrogate", "POST", P, b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "prompt", ["surrogate"]),
    ("chat template path smuggled", "POST", C, chat(chat_template_kwargs={"chat_template": "/etc/passwd"}), 400,
     "chat_template_kwargs", ["chat_template"]),
    ("echo with logprobs", "POST", P, completion(echo=True, logprobs=1), 400, "echo", ["logprobs"]),
    ("body over the size limit", "POST", P, b'{"prompt": "' + b"a" * (MAX_REQUEST_BYTES + 10) + b'"}', 413, "body",
     [str(MAX_REQUEST_BYTES)]),
    ("invalid UTF-8", "POST", P, b'{"prompt": "\xff\xfe", "max_tokens": 2}', 400, "body", ["UTF-8", "byte 12"]),
    ("invalid JSON", "POST", P, b'{"prompt": "hi", max_tokens: 2}', 400, "body", ["JSON", "line 1"]),
    ("NaN in JSON", "POST", P, b'{"prompt": "hi", "temperature": NaN}', 400, "body", ["NaN"]),
    ("empty body", "POST", C, b"", 400, "body", ["empty"]),
    ("body a JSON array", "POST", C, b"[1, 2, 3]", 400, "body", ["object", "list"]),
    ("JSON nested 100,000 deep", "POST", C, b"[" * 100_000 + b"]" * 100_000, 400, "body", ["deeply"]),
]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    proc = ServeProcess({"MODEL_NAME": smollm2_dir, "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "smollm2-hostile",
                         "MAX_MODEL_LEN": str(MAX_MODEL_LEN), "DEVICE": "cpu", "LOG_LEVEL": "WARNING",
                         "MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES)})
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        yield client


def test_there_are_at_least_30_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hostile_request_gets_a_precise_error_and_the_server_lives_on(http, case):
    _, method, path, body, status, param, words = case
    if isinstance(body, bytes) or body is None:
        resp = http.request(method, path, content=body, headers={"Content-Type": "application/json"})
    else:
        resp = http.request(method, path, json=body)
    assert resp.status_code == status, resp.text[:500]
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == status
    if param is not None:
        assert error["message"].startswith(param.split("[")[0]), error["message"]
    for word in words:
        assert word in error["message"], error["message"]
    assert len(error["message"]) < 1000  # never an echo of a huge input
    # A normal request right after still succeeds.
    ok = http.post(P, json={"prompt": "The sky is", "max_tokens": 1, "temperature": 0})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 1


def test_an_error_mid_stream_request_does_not_leak(http):
    """A streaming request refused before its first chunk is a plain 4xx, not a broken event stream."""
    resp = http.post(P, json=completion(stream=True, max_tokens=100_000))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_the_server_is_still_healthy_after_every_case(http, server):
    metrics = http.get("/metrics").text
    assert "coldbrew_num_requests_running 0" in metrics
    assert server.proc.poll() is None
    body = json.loads(http.get("/v1/models").text)
    assert body["data"][0]["id"] == "smollm2-hostile"
