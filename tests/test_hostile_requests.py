"""Malformed and hostile requests against one `python -m handler serve` process: each gets a precise
OpenAI-shaped 4xx naming the field at fault, and a normal request right after it still succeeds.
Also the connection itself: header and request-line limits, nesting at several depths, slow and
vanishing clients (timed out, or let go with one info line), no redirect built from the Host header;
and nothing a client does leaves a traceback in the log.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

import httpx
import pytest

from handler.limits import MAX_HEADER_BYTES, MAX_JSON_DEPTH, MAX_REQUEST_LINE_BYTES
from tests.serve_process import ServeProcess

MAX_MODEL_LEN = 512
MAX_REQUEST_BYTES = 16 << 20
HEADER_TIMEOUT_S = 2
BODY_TIMEOUT_S = 3
HI = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return {"messages": HI, "max_tokens": 2, **fields}


def completion(**fields):
    return {"prompt": "hi", "max_tokens": 2, **fields}


C, P = "/v1/chat/completions", "/v1/completions"
# (case id, method, path, body: a dict sent as JSON or raw bytes, status, param, words the message
# must contain)
CASES = [
    ("missing messages", "POST", C, {"max_tokens": 2}, 400, "messages", ["messages", "required"]),
    ("messages not a list", "POST", C, {"messages": "hi"}, 400, "messages", ["messages", "list"]),
    ("empty messages", "POST", C, {"messages": []}, 400, "messages", ["messages", "at least 1"]),
    (
        "message without role",
        "POST",
        C,
        {"messages": [{"content": "hi"}]},
        400,
        "messages[0].role",
        ["required"],
    ),
    (
        "unknown role",
        "POST",
        C,
        {"messages": [{"role": "bot", "content": "hi"}]},
        400,
        "messages[0].role",
        ["'user'"],
    ),
    (
        "content a number",
        "POST",
        C,
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "messages[0].content",
        ["string", "text parts", "int"],
    ),
    (
        "image content part",
        "POST",
        C,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ]
        },
        400,
        "messages[0].content[0]",
        ["image_url", "not supported"],
    ),
    ("max_tokens a string", "POST", C, chat(max_tokens="5"), 400, "max_tokens", ["integer", "str"]),
    (
        "max_tokens negative",
        "POST",
        C,
        chat(max_tokens=-1),
        400,
        "max_tokens",
        ["greater than or equal to 1"],
    ),
    (
        "max_tokens huge",
        "POST",
        P,
        completion(max_tokens=10**12),
        400,
        "max_tokens",
        ["less than or equal"],
    ),
    (
        "max_tokens over the context",
        "POST",
        P,
        completion(max_tokens=100_000),
        400,
        "max_tokens",
        ["100000", str(MAX_MODEL_LEN)],
    ),
    (
        "max_completion_tokens over the context",
        "POST",
        C,
        {"messages": HI, "max_completion_tokens": 5000},
        400,
        "max_completion_tokens",
        ["5000", str(MAX_MODEL_LEN)],
    ),
    ("n zero", "POST", C, chat(n=0), 400, "n", ["greater than or equal to 1"]),
    ("n huge", "POST", P, completion(n=100_000), 400, "n", ["less than or equal to 128"]),
    (
        "temperature negative",
        "POST",
        C,
        chat(temperature=-1),
        400,
        "temperature",
        ["greater than or equal to 0"],
    ),
    (
        "temperature a string",
        "POST",
        C,
        chat(temperature="hot"),
        400,
        "temperature",
        ["number", "str"],
    ),
    ("top_p zero", "POST", P, completion(top_p=0), 400, "top_p", ["greater than 0"]),
    (
        "top_k below -1",
        "POST",
        P,
        completion(top_k=-5),
        400,
        "top_k",
        ["greater than or equal to -1"],
    ),
    (
        "presence_penalty out of range",
        "POST",
        C,
        chat(presence_penalty=5),
        400,
        "presence_penalty",
        ["2"],
    ),
    (
        "stop list of 10,000 strings",
        "POST",
        C,
        chat(stop=[f"s{i}" for i in range(10_000)]),
        400,
        "stop",
        ["at most 64", "10000"],
    ),
    ("stop a number", "POST", P, completion(stop=7), 400, "stop", ["string", "list"]),
    ("stop string too long", "POST", P, completion(stop="x" * 5000), 400, "stop", ["1024"]),
    ("seed a string", "POST", P, completion(seed="abc"), 400, "seed", ["integer"]),
    ("stream not a bool", "POST", C, chat(stream="yes"), 400, "stream", ["boolean"]),
    (
        "stream_options without stream",
        "POST",
        C,
        chat(stream_options={"include_usage": True}),
        400,
        "stream_options",
        ["stream"],
    ),
    (
        "min_tokens over max_tokens",
        "POST",
        P,
        completion(min_tokens=5, max_tokens=2),
        400,
        "min_tokens",
        ["max_tokens", "5"],
    ),
    (
        "top_logprobs too many",
        "POST",
        C,
        chat(logprobs=True, top_logprobs=50),
        400,
        "top_logprobs",
        ["20"],
    ),
    ("completion logprobs too many", "POST", P, completion(logprobs=100), 400, "logprobs", ["20"]),
    (
        "json_schema response_format without a schema",
        "POST",
        C,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        "response_format.json_schema.schema",
        ["required"],
    ),
    (
        "guided_json beside response_format",
        "POST",
        C,
        chat(guided_json={"type": "object"}, response_format={"type": "json_object"}),
        400,
        "guided_json",
        ["cannot be combined with response_format"],
    ),
    (
        "a schema keyword the grammar engine cannot enforce",
        "POST",
        C,
        chat(guided_json={"type": "array", "uniqueItems": True}),
        400,
        "guided_json",
        ["uniqueItems"],
    ),
    (
        "logit_bias on a token id outside the vocabulary",
        "POST",
        P,
        completion(logit_bias={"50256000": -100}),
        400,
        "logit_bias",
        ["token ids in [0, 49152)"],
    ),
    (
        "logit_bias over 100",
        "POST",
        P,
        completion(logit_bias={"50": 101}),
        400,
        "logit_bias[50]",
        ["[-100, 100]"],
    ),
    ("unknown model", "POST", C, chat(model="gpt-4o"), 404, "model", ["gpt-4o", "smollm2-hostile"]),
    (
        "unknown route",
        "POST",
        "/v1/engines/davinci/completions",
        completion(),
        404,
        None,
        ["/v1/completions"],
    ),
    ("wrong method", "GET", C, None, 405, None, ["GET"]),
    (
        "10 MB prompt",
        "POST",
        P,
        completion(prompt="a" * (10 << 20)),
        400,
        "prompt",
        [str(10 << 20), str(MAX_MODEL_LEN)],
    ),
    (
        "prompt over the context",
        "POST",
        P,
        completion(prompt="hello " * 600),
        400,
        "prompt",
        ["tokens exceed the context limit", str(MAX_MODEL_LEN)],
    ),
    (
        "messages over the context",
        "POST",
        C,
        {"messages": [{"role": "user", "content": "hello " * 600}]},
        400,
        "messages",
        [str(MAX_MODEL_LEN)],
    ),
    ("empty prompt", "POST", P, completion(prompt=""), 400, "prompt", ["empty"]),
    (
        "token id out of vocabulary",
        "POST",
        P,
        completion(prompt=[1, 2, 10**9]),
        400,
        "prompt",
        ["1000000000", "49152"],
    ),
    ("prompt list of mixed types", "POST", P, completion(prompt=["a", 1]), 400, "prompt", ["list"]),
    ("prompt missing", "POST", P, {"max_tokens": 2}, 400, "prompt", ["required"]),
    (
        "too many choices",
        "POST",
        P,
        completion(prompt=["hi"] * 20, n=100),
        400,
        "n",
        ["2000", "1024"],
    ),
    (
        "lone surrogate",
        "POST",
        P,
        b'{"prompt": "a\\ud800b", "max_tokens": 2}',
        400,
        "prompt",
        ["surrogate"],
    ),
    (
        "chat template path smuggled",
        "POST",
        C,
        chat(chat_template_kwargs={"chat_template": "/etc/passwd"}),
        400,
        "chat_template_kwargs",
        ["chat_template"],
    ),
    ("echo with logprobs", "POST", P, completion(echo=True, logprobs=1), 400, "echo", ["logprobs"]),
    (
        "body over the size limit",
        "POST",
        P,
        b'{"prompt": "' + b"a" * (MAX_REQUEST_BYTES + 10) + b'"}',
        413,
        "body",
        [str(MAX_REQUEST_BYTES)],
    ),
    (
        "invalid UTF-8",
        "POST",
        P,
        b'{"prompt": "\xff\xfe", "max_tokens": 2}',
        400,
        "body",
        ["UTF-8", "byte 12"],
    ),
    (
        "invalid JSON",
        "POST",
        P,
        b'{"prompt": "hi", max_tokens: 2}',
        400,
        "body",
        ["JSON", "line 1"],
    ),
    ("NaN in JSON", "POST", P, b'{"prompt": "hi", "temperature": NaN}', 400, "body", ["NaN"]),
    ("empty body", "POST", C, b"", 400, "body", ["empty"]),
    ("body a JSON array", "POST", C, b"[1, 2, 3]", 400, "body", ["object", "list"]),
    (
        "JSON nested 100,000 deep",
        "POST",
        C,
        b"[" * 100_000 + b"]" * 100_000,
        400,
        "body",
        ["nested deeper", str(MAX_JSON_DEPTH)],
    ),
    (
        "lone surrogate in a message",
        "POST",
        C,
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udc00"}]}]}',
        400,
        "messages[0].content",
        ["surrogate"],
    ),
    (
        "repetition_penalty 1e-300",
        "POST",
        C,
        chat(repetition_penalty=1e-300),
        400,
        "repetition_penalty",
        ["greater than or equal to 0.01"],
    ),
    (
        "tools with tool_choice auto and no parser for this template",
        "POST",
        C,
        chat(tools=[{"type": "function", "function": {"name": "f"}}]),
        400,
        "tools",
        ["TOOL_CALL_PARSER"],
    ),
    (
        "tool_choice required without tools",
        "POST",
        C,
        chat(tool_choice="required"),
        400,
        "tool_choice",
        ["needs tools"],
    ),
    (
        "tool_choice naming a function that is not among the tools",
        "POST",
        C,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        "tool_choice",
        ["'g' is not among the tools"],
    ),
    (
        "the deprecated functions field",
        "POST",
        C,
        chat(functions=[{"name": "f"}]),
        400,
        "functions",
        ["send tools"],
    ),
    (
        "request target over the limit",
        "GET",
        "/v1/models?" + "q" * MAX_REQUEST_LINE_BYTES,
        None,
        414,
        None,
        [str(MAX_REQUEST_LINE_BYTES)],
    ),
]


# Where a client can hide a deep value: (the body around a placeholder, the body's levels above
# the value, the top-level field that holds it, the answer when the depth is within the limit).
_DEEP = "__deep__"
_DEEP_MESSAGE = {"role": "user", "content": "hi", "meta": _DEEP}
NESTING_SPOTS = {
    "chat_template_kwargs": (
        chat(chat_template_kwargs={"deep": _DEEP}),
        2,
        "chat_template_kwargs",
        200,
    ),
    "extra message field": ({"messages": [_DEEP_MESSAGE], "max_tokens": 2}, 3, "messages", 200),
    # refused anyway, but for its depth only past the limit
    "tools": (chat(tools=[_DEEP]), 2, "tools", 400),
}


@pytest.fixture(scope="module")
def server(smollm2_dir):
    proc = ServeProcess(
        {
            "MODEL_NAME": smollm2_dir,
            "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "smollm2-hostile",
            "MAX_MODEL_LEN": str(MAX_MODEL_LEN),
            "DEVICE": "cpu",
            "LOG_LEVEL": "INFO",
            "MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES),
            "HTTP_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
            "HTTP_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
        }
    )
    yield proc
    assert proc.stop() == 0, proc.output()  # SIGTERM on an idle server: a clean drain


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
        resp = http.request(
            method, path, content=body, headers={"Content-Type": "application/json"}
        )
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
    """A streaming request refused before its first chunk is a plain 4xx, not a broken event
    stream."""
    resp = http.post(P, json=completion(stream=True, max_tokens=100_000))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


@pytest.mark.parametrize("depth", [8, "limit", "limit+1", 600, 5000])
@pytest.mark.parametrize("spot", NESTING_SPOTS)
def test_nesting_at_several_depths(http, spot, depth):
    """A value nested past MAX_JSON_DEPTH anywhere is a 400 naming the field that holds it (past
    the JSON parser's own guard, about 1,000 levels, the body), never a 500: the depth is checked
    before anything recursive runs."""
    body, above, field, status_within = NESTING_SPOTS[spot]
    room = MAX_JSON_DEPTH - above
    levels = {"limit": room, "limit+1": room + 1}.get(depth, depth)
    text = json.dumps(body).replace(json.dumps(_DEEP), "[" * levels + "0" + "]" * levels)
    resp = http.post(C, content=text.encode(), headers={"Content-Type": "application/json"})
    error = resp.json().get("error")
    if levels + above <= MAX_JSON_DEPTH:
        assert resp.status_code == status_within, resp.text[:300]
        if error is not None:
            assert "nested" not in error["message"]
        return
    assert resp.status_code == 400, resp.text[:300]
    assert error["param"] in ((field,) if levels < 900 else (field, "body")), error
    assert error["message"] == (
        f"{error['param']}: objects and lists nested deeper than the limit "
        f"of {MAX_JSON_DEPTH} levels"
    )


def _raw(server, data: bytes, timeout: float = 30) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
    if data:
        sock.sendall(data)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    return out


def _head(path="/v1/completions", extra: bytes = b"", length: int | None = None) -> bytes:
    line = f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n".encode()
    if length is not None:
        line += f"Content-Length: {length}\r\n".encode()
    return line + extra + b"\r\n"


def _log_count(server, words: str) -> int:
    return sum(words in line for line in list(server.lines))


def _wait_log(server, words: str, count: int, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while _log_count(server, words) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    return _log_count(server, words)


def test_a_header_block_over_the_limit_is_refused_and_the_server_lives_on(http, server):
    ok = http.get("/v1/models", headers={"X-Pad": "a" * 8192})
    assert ok.status_code == 200
    pad = b"X-Pad: " + b"a" * (MAX_HEADER_BYTES + 1024) + b"\r\n"
    big = _raw(server, _head(extra=pad, length=2) + b"{}")
    answer = _read_all(big)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    # 64 MiB of header: the server closes the connection once the header block passes the limit,
    # never buffering it.
    huge = _raw(server, b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-Pad: ")
    sent, refused = 0, False
    try:
        while sent < 64 << 20:
            huge.sendall(b"a" * (1 << 20))
            sent += 1 << 20
    except (BrokenPipeError, ConnectionResetError):
        refused = True
    answer = _read_all(huge)
    assert refused or answer.startswith(b"HTTP/1.1 400"), (sent, answer[:200])
    assert sent < 64 << 20
    assert http.post(P, json={"prompt": "The sky is", "max_tokens": 1}).status_code == 200


def test_slow_clients_are_timed_out_and_the_server_keeps_answering(http, server):
    """Slowloris, bounded: a silent connection, one trickling its headers, one trickling its body.
    Each gets a 408 naming the setting once its deadline passes (trickling does not extend it)
    while others are served."""
    before = _log_count(server, "did not arrive within")
    silent = _raw(server, b"")
    headers = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
    body = _raw(server, _head(length=200) + b'{"prompt": ')
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.25):
            for sock, byte in ((headers, b"X"), (body, b" ")):
                try:
                    sock.send(byte)
                except OSError:
                    pass

    feeder = threading.Thread(target=trickle, daemon=True)
    feeder.start()
    try:
        assert http.post(P, json={"prompt": "The sky is", "max_tokens": 1}).status_code == 200
        answers = [_read_all(sock) for sock in (silent, headers, body)]
    finally:
        stop.set()
        feeder.join()
    settings = ("HTTP_HEADER_TIMEOUT_S", "HTTP_HEADER_TIMEOUT_S", "HTTP_BODY_TIMEOUT_S")
    for answer, setting in zip(answers, settings):
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == 408 and setting in error["message"], error
    assert _wait_log(server, "did not arrive within", before + 3) == before + 3
    assert http.get("/health").status_code == 200


def test_clients_that_vanish_mid_request_are_let_go_quietly(http, server):
    """Less body than Content-Length then a close, a reset mid-body, a reset mid-stream: one info
    line each (for the first two), no traceback, and the server goes on."""
    left = "the client left before its request body was in"
    before = _log_count(server, left)
    short = _raw(server, _head(length=1000) + b'{"prompt": "hi"')
    short.shutdown(socket.SHUT_WR)
    _read_all(short)
    reset = _raw(server, _head(length=1000) + b'{"prompt": "hi"')
    time.sleep(0.2)  # the server has read the headers and waits for the body
    reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    reset.close()  # an RST
    story = json.dumps(
        {"prompt": "Tell me a story", "max_tokens": 200, "stream": True, "ignore_eos": True}
    ).encode()
    streaming = _raw(server, _head(length=len(story)) + story)
    assert streaming.recv(100).startswith(b"HTTP/1.1 200")
    streaming.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    streaming.close()
    assert _wait_log(server, left, before + 2) == before + 2
    assert http.post(P, json={"prompt": "The sky is", "max_tokens": 1}).status_code == 200


def test_a_trailing_slash_is_answered_never_redirected_to_the_host_header(http):
    for method, path, body in (
        ("POST", P + "/", completion()),
        ("POST", "/openai" + C + "/", chat()),
        ("GET", "/v1/models/", None),
        ("GET", "/health/", None),
    ):
        resp = http.request(method, path, json=body, headers={"Host": "attacker.example"})
        assert resp.status_code == 200, (path, resp.status_code, resp.text[:200])
        assert "location" not in resp.headers


def test_the_server_is_still_healthy_after_every_case(http, server):
    metrics = http.get("/metrics").text
    assert "coldbrew_num_requests_running 0" in metrics
    assert server.proc.poll() is None
    body = json.loads(http.get("/v1/models").text)
    assert body["data"][0]["id"] == "smollm2-hostile"


def test_nothing_a_client_did_left_a_traceback(server):
    """Runs last in this module: every case above was a client's doing; none may leave a
    traceback in the log."""
    log = "".join(server.lines)
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-5000:]
