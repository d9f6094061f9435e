"""One input, one meaning: for a seeded, generated set of inputs (messages with text parts, tools,
sampling fields, valid or not), the RunPod job faces (prompt/messages jobs, openai_route and v2.24's
route/body jobs, through the worker's job handler) and the HTTP face (the server's app, through an
HTTP client) ask the real engine for the same request (prompt token ids and SamplingParams), or
refuse it with the same message naming the same field.
"""

from __future__ import annotations

import json
import random

import pytest
from starlette.testclient import TestClient

from handler import limits
from handler.admission import Admission
from handler.config import load_settings
from handler.engine_boot import EngineBoot
from handler.server import build_app
from handler.worker import Worker

CASES = 40
SEED = 20261123
# The last two are drawn rarely: a lone surrogate (refused) and a plain question.
TEXTS = [
    "Hello",
    "What is 2+2?",
    "",
    "line one\nline two",
    "Café, 中文, 🙂",
    "  spaced  ",
    "a\ud800b",
    "Name a color.",
]


class RecordingEngine:
    """The real AsyncLLM; each request it is asked to run (prompt ids, SamplingParams) is noted."""

    def __init__(self, engine):
        self._engine = engine
        self.requests: list[tuple[list[int], object]] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, request_id, prompt, params=None):
        self.requests.append((list(prompt), params))
        return self._engine.generate(request_id, prompt, params)

    def take(self) -> list:
        taken, self.requests = self.requests, []
        return taken


class RecordingBoot:
    """The loaded EngineBoot, handing out the recording engine."""

    def __init__(self, boot: EngineBoot, engine: RecordingEngine):
        self._boot = boot
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self._boot, name)

    def start(self):
        return self

    async def ready(self):
        return self.engine

    def engine_now(self):
        return self.engine


@pytest.fixture(scope="module")
def faces(smollm2_dir):
    # DEFAULT_MAX_TOKENS keeps generation short when a case sets no max_tokens (every face applies
    # it the same way).
    settings = load_settings(
        {
            "MODEL_NAME": smollm2_dir,
            "MAX_MODEL_LEN": "512",
            "DEVICE": "cpu",
            "DEFAULT_MAX_TOKENS": "3",
        }
    )
    boot = EngineBoot(settings)
    engine = RecordingEngine(boot.load_blocking())
    recording = RecordingBoot(boot, engine)
    worker = Worker(settings, recording, Admission(8, recording, occupancy=lambda: 0))
    with TestClient(build_app(settings, recording)) as http:
        yield worker, http, engine
    boot.engine_now().shutdown()


def _text(rng: random.Random) -> str:
    return rng.choice(TEXTS[:-2] if rng.random() < 0.9 else TEXTS)


def _content(rng: random.Random):
    if rng.random() < 0.5:
        return _text(rng)
    return [{"type": "text", "text": _text(rng)} for _ in range(rng.randint(1, 3))]


def _messages(rng: random.Random) -> list[dict]:
    messages = [{"role": "system", "content": _content(rng)}] if rng.random() < 0.3 else []
    for i in range(rng.randint(1, 3)):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": _content(rng)})
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": _content(rng)})
    roll = rng.random()
    if roll < 0.05:
        messages.insert(-1, {"role": "tool", "tool_call_id": "c1", "content": "4"})
    elif roll < 0.1:
        call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
        messages.insert(-1, {"role": "assistant", "content": None, "tool_calls": [call]})
    return messages


# Each field's values: most are valid, some are out of range or of the wrong type.
VALUES = {
    "temperature": [0, 0, 0.7, 1.3, -1, 3.0, "hot"],
    "top_p": [0.9, 1, 0, 1.5],
    "top_k": [-1, 0, 5, -3],
    "min_p": [0, 0.1, 2],
    "repetition_penalty": [1.0, 1.2, 0.5, 1e-300, 0, 11],
    "presence_penalty": [0, 0.5, -2, 3],
    "frequency_penalty": [0, -0.5, 2.5],
    "seed": [0, 7, 2**70, -5],
    "stop": ["\n", ["a", "b"], [], ["x"] * (limits.MAX_STOP_STRINGS + 1), 5],
    "stop_token_ids": [[1, 2], [], [-1]],
    "max_tokens": [1, 2, 3, 10**9, 0, 5000],
    "min_tokens": [0, 1, 5],
    "n": [1, 2, 0, limits.MAX_N + 1],
    "ignore_eos": [True, False, "yes"],
    "skip_special_tokens": [True, False],
    "include_stop_str_in_output": [True, False, 1],
}


def _sampling(rng: random.Random) -> dict:
    names = rng.sample(sorted(VALUES), rng.randint(0, 6))
    return {name: rng.choice(VALUES[name]) for name in names}


def _case(rng: random.Random) -> tuple[str, dict, dict]:
    """(route, job input as a prompt/messages job, the OpenAI body that means the same)."""
    sampling = _sampling(rng)
    if rng.random() < 0.65:
        messages = _messages(rng)
        job = {"messages": messages, "sampling_params": sampling}
        body, route = {"messages": messages, **sampling}, "/v1/chat/completions"
    elif rng.random() < 0.2:
        text = _text(rng)
        job = {"prompt": text, "apply_chat_template": True, "sampling_params": sampling}
        body = {"messages": [{"role": "user", "content": text}], **sampling}
        route = "/v1/chat/completions"
    else:
        if rng.random() < 0.8:
            prompt = _text(rng)
        else:
            prompt = [rng.randrange(1, 49152) for _ in range(rng.randint(1, 5))]
        job = {"prompt": prompt, "sampling_params": sampling}
        body, route = {"prompt": prompt, **sampling}, "/v1/completions"
    roll = rng.random()
    if roll < 0.1:
        function = {"name": "add", "parameters": {"type": "object"}}
        tools = [{"type": "function", "function": function}]
        job["tools"] = body["tools"] = tools
    elif roll < 0.15:
        choice = rng.choice(["auto", "none", "required"])
        job["sampling_params"]["tool_choice"] = body["tool_choice"] = choice
    return route, job, body


def _after_field(message: str) -> str:
    return message.split(": ", 1)[1]


def _job_field(job: dict, param: str) -> str:
    """Where a prompt/messages job's error names the field the HTTP face names `param`."""
    head = param.split(".")[0].split("[")[0]
    if head in job["sampling_params"]:
        return f"input.sampling_params.{param}"
    if job.get("apply_chat_template") and head == "messages":
        return "input.prompt"
    return f"input.{param}"


async def _job(worker: Worker, job_id: str, job_input: dict) -> tuple[list, str | dict | None]:
    outputs = [item async for item in worker.handle({"id": job_id, "input": job_input})]
    errors = [o["error"] for o in outputs if isinstance(o, dict) and "error" in o]
    return outputs, (errors[-1] if errors else None)


async def test_every_face_asks_the_engine_for_the_same_request(faces):
    worker, http, engine = faces
    rng = random.Random(SEED)
    served, refused = 0, 0
    for i in range(CASES):
        route, job, body = _case(rng)
        where = f"case {i}: {job!r}"
        _, job_error = await _job(worker, f"job-{i}", job)
        from_job = engine.take()
        openai_job = {"openai_route": route, "openai_input": body}
        _, openai_error = await _job(worker, f"oa-{i}", openai_job)
        from_openai_job = engine.take()
        _, route_error = await _job(worker, f"route-{i}", {"route": route, "body": body})
        from_route_job = engine.take()
        # JSON with escapes (ensure_ascii): a lone surrogate travels as clients send it, \\ud800.
        resp = http.post(
            route, content=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        from_http = engine.take()
        if resp.status_code == 200:
            served += 1
            assert job_error is None and openai_error is None and route_error is None, where
            assert len(from_http) == 1, where
            assert from_job == from_openai_job == from_route_job == from_http, where
        else:
            refused += 1
            http_error = resp.json()["error"]
            assert resp.status_code == 400, (where, http_error)
            assert from_job == from_openai_job == from_route_job == from_http == [], where
            assert route_error == http_error, where  # v2.24's form answers the HTTP error object
            assert openai_error == f"input.openai_input.{http_error['message']}", where
            field = _job_field(job, http_error["param"])
            assert job_error.startswith(field + ": "), (where, job_error)
            assert _after_field(job_error) == _after_field(http_error["message"]), where
    # The generator reaches both outcomes often enough to mean something.
    assert served >= CASES // 5 and refused >= CASES // 5, (served, refused)


def test_the_handler_limits_agree_with_the_engine():
    from engine import sampling_params as sampling

    assert limits.MAX_N == sampling.MAX_N
    assert limits.MAX_TOP_LOGPROBS == sampling.MAX_LOGPROBS
    assert limits.MAX_STOP_STRINGS == sampling.MAX_STOP_STRINGS
    assert limits.MAX_STOP_CHARS == sampling.MAX_STOP_STRING_CHARS
    assert limits.MAX_STOP_TOKEN_IDS == sampling.MAX_STOP_TOKEN_IDS
    assert limits.MIN_REPETITION_PENALTY == sampling.MIN_REPETITION_PENALTY
    with pytest.raises(ValueError, match="^repetition_penalty: must be >= 0.01, got 1e-300"):
        sampling.SamplingParams(repetition_penalty=1e-300)
