"""The real runpod SDK worker loop (`python -m handler` in a subprocess) taking jobs from a local
queue on loopback: both input shapes, streamed or not, concurrent, cancelled, malformed, SIGTERM;
outputs equal engine.LLM's greedy ones. Also worker-vllm v2.24+'s route/body/method jobs, tools
refused, and streams ended with an error past the grace period (exit 0).

`make test` also runs this file with the oldest runpod we admit first on PYTHONPATH
(COLDBREW_RUNPOD_VERSION names the version the SDK's process must send as its User-Agent).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from child_process import repo_pythonpath, stop
from engine import LLM, SamplingParams
from runpod_jobs_server import RunPodJobServer

REPO = Path(__file__).resolve().parent.parent
MAX_MODEL_LEN = 2048
WAIT_S = 240  # generous: CI shares 2 cores between the worker and the test


def _start_worker(
    server: RunPodJobServer, model_dir: str, log_path: Path, pod_id: str, **env
) -> subprocess.Popen:
    full_env = {
        **os.environ,
        **server.env(pod_id),
        "MODEL_NAME": model_dir,
        "MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "DEVICE": "cpu",
        "MAX_CONCURRENCY": "4",
        "PYTHONPATH": repo_pythonpath(),
        **env,
    }
    log = open(log_path, "wb")
    # stop() ends the SDK's heartbeat too
    return subprocess.Popen(
        [sys.executable, "-m", "handler"],
        cwd=REPO,
        env=full_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    return LLM(model=smollm2_dir, max_model_len=MAX_MODEL_LEN, device="cpu")


@pytest.fixture(scope="module")
def worker(smollm2_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("worker") / "worker.log"
    with RunPodJobServer() as server:
        proc = _start_worker(server, smollm2_dir, log_path, "pod-main")
        try:
            yield server.queue
        finally:
            code = stop(proc)
    # SIGTERM on the idle worker: a clean drain, exit 0 (not the signal's 143).
    assert code == 0, log_path.read_text(errors="replace")[-5000:]


def _wait_done(queue, *job_ids, timeout=WAIT_S):
    assert queue.wait_for(lambda: all(queue.done.get(j) for j in job_ids), timeout), (
        f"no result for {[j for j in job_ids if not queue.done.get(j)]}"
    )
    return [queue.done[j][-1] for j in job_ids]


def _greedy(max_tokens: int, **extra) -> dict:
    return {"temperature": 0, "max_tokens": max_tokens, **extra}


def _text(batches: list[dict], index: int = 0) -> str:
    return "".join("".join(b["choices"][index]["tokens"]) for b in batches)


PROMPT = "The three primary colors are"
MESSAGES = [{"role": "user", "content": "Name a fruit that is yellow."}]


@pytest.mark.slow
def test_prompt_and_messages_jobs_match_greedy_engine(worker, reference, smollm2_dir):
    ref = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))[0]
    ref_chat = reference.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=10))[0]
    worker.put("plain", {"prompt": PROMPT, "sampling_params": _greedy(12)})
    worker.put("plain-stream", {"prompt": PROMPT, "sampling_params": _greedy(12), "stream": True})
    worker.put("chat", {"messages": MESSAGES, "sampling_params": _greedy(10)})
    worker.put(
        "chat-stream", {"messages": MESSAGES, "sampling_params": _greedy(10), "stream": True}
    )
    plain, plain_stream, chat, chat_stream = _wait_done(
        worker, "plain", "plain-stream", "chat", "chat-stream"
    )

    # Not streamed: one batch holding the whole text, worker-vllm's shape, plus usage and
    # finish_reason (and the worker's metrics block, checked in test_worker_capacity.py).
    assert plain["output"][0].pop("metrics")["queue_wait_s"] >= 0
    assert plain["output"] == [
        {
            "choices": [{"tokens": [ref.outputs[0].text], "finish_reason": "length"}],
            "usage": {"input": len(ref.prompt_token_ids), "output": 12},
        }
    ]
    assert chat["output"][0]["choices"][0]["tokens"] == [ref_chat.outputs[0].text]
    assert chat["output"][0]["usage"] == {
        "input": len(ref_chat.prompt_token_ids),
        "output": len(ref_chat.outputs[0].token_ids),
    }
    # Streamed: the pieces join into the same text, and the aggregate result repeats the streamed
    # batches.
    streamed = [post["output"] for post in worker.streams["plain-stream"]]
    assert _text(streamed) == ref.outputs[0].text
    assert plain_stream["output"] == streamed
    assert _text(chat_stream["output"]) == ref_chat.outputs[0].text
    # Batches grow: >= 1 token (DEFAULT_MIN_BATCH_SIZE), then >= 3, >= 9 ... (factor 3), the last
    # one holds the rest.
    outs = [b["usage"]["output"] for b in streamed]
    sizes = [outs[0]] + [b - a for a, b in zip(outs, outs[1:])]
    assert len(streamed) >= 3 and sizes[0] >= 1 and sizes[1] >= 3
    assert outs[-1] == 12


@pytest.mark.slow
def test_openai_route_jobs_match_greedy_engine(worker, reference, smollm2_dir):
    ref_chat = (
        reference.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    )
    ref = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    chat = {"model": smollm2_dir, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    worker.put("oa-chat", {"openai_route": "/v1/chat/completions", "openai_input": chat})
    worker.put(
        "oa-chat-stream",
        {"openai_route": "/v1/chat/completions", "openai_input": {**chat, "stream": True}},
    )
    worker.put(
        "oa-completion",
        {
            "openai_route": "/openai/v1/completions",  # the path RunPod's /openai/v1 uses
            "openai_input": {
                "model": smollm2_dir,
                "prompt": PROMPT,
                "max_tokens": 8,
                "temperature": 0,
            },
        },
    )
    worker.put("oa-models", {"openai_route": "/v1/models"})
    res_chat, res_stream, res_completion, res_models = _wait_done(
        worker, "oa-chat", "oa-chat-stream", "oa-completion", "oa-models"
    )

    assert res_chat["output"][0]["choices"][0]["message"]["content"] == ref_chat
    assert res_completion["output"][0]["choices"][0]["text"] == ref
    assert smollm2_dir in [m["id"] for m in res_models["output"][0]["data"]]
    # RAW_OPENAI_OUTPUT (default on): each batch is a string of SSE lines; the last one ends in
    # [DONE].
    raw = "".join(res_stream["output"])
    events = [line[len("data: ") :] for line in raw.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    deltas = [json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]]
    assert "".join(deltas) == ref_chat


@pytest.mark.slow
def test_several_jobs_run_at_once(worker, reference):
    prompts = [f"Write a list of {k} animals:" for k in ("three", "four", "five", "six")]
    refs = [
        o.outputs[0].text
        for o in reference.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    ]
    ids = [f"many-{i}" for i in range(len(prompts))]
    start = len(worker.events)
    for job_id, prompt in zip(ids, prompts):
        worker.put(job_id, {"prompt": prompt, "sampling_params": _greedy(12), "stream": True})
    results = _wait_done(worker, *ids)
    assert [_text(r["output"]) for r in results] == refs
    # Concurrency > 1: at some point several jobs had streamed output and none of them had finished
    # yet.
    open_jobs, most_open = set(), 0
    for kind, job_id in worker.events[start:]:
        if job_id in ids:
            (open_jobs.add if kind == "stream" else open_jobs.discard)(job_id)
            most_open = max(most_open, len(open_jobs))
    assert most_open >= 2


@pytest.mark.slow
def test_cancelled_job_stops_and_the_worker_goes_on(worker, reference):
    worker.put(
        "cancel-me",
        {
            "prompt": "Count from one to a thousand:",
            "stream": True,
            "sampling_params": _greedy(1500, ignore_eos=True),
        },
    )
    assert worker.wait_for(lambda: len(worker.streams["cancel-me"]) >= 2, WAIT_S)
    worker.stop("cancel-me")
    # The SDK's job-stop poll takes it (without that poll, runpod < 1.10, the job would run on
    # unseen here: its next streamed batch is far off)
    assert worker.wait_for(lambda: "cancel-me" in worker.stops_taken, 30)
    worker.put("after-cancel-1", {"prompt": PROMPT, "sampling_params": _greedy(8)})
    _wait_done(worker, "after-cancel-1")
    posted = len(worker.streams["cancel-me"])
    worker.put("after-cancel-2", {"prompt": PROMPT, "sampling_params": _greedy(8)})
    (after,) = _wait_done(worker, "after-cancel-2")
    ref = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    assert after["output"][0]["choices"][0]["tokens"] == [ref]
    # The stopped job streams no more and never gets a result of its own (RunPod already counts it
    # as cancelled).
    assert len(worker.streams["cancel-me"]) == posted
    assert "cancel-me" not in worker.done
    last = worker.streams["cancel-me"][-1]["output"]["usage"]["output"]
    assert last < 1500


@pytest.mark.slow
def test_agent_requests_through_jobs(worker, smollm2_dir):
    """What agents send works through RunPod jobs too: a JSON schema (openai_route), a required
    tool call (route/body), /v1/responses and /tokenize."""
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["paris", "rome"]}, "n": {"type": "integer"}},
        "required": ["city", "n"],
        "additionalProperties": False,
    }
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": schema}}
    base = {"model": smollm2_dir, "messages": MESSAGES, "max_tokens": 60, "temperature": 0}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    worker.put(
        "ag-json",
        {"openai_route": "/v1/chat/completions", "openai_input": {**base, "response_format": fmt}},
    )
    worker.put(
        "ag-tool",
        {
            "route": "/v1/chat/completions",
            "body": {
                **base,
                "tools": [tool],
                "tool_choice": "required",
                "parallel_tool_calls": False,
            },
        },
    )
    worker.put(
        "ag-resp", {"route": "/v1/responses", "body": {"input": "hi", "max_output_tokens": 4}}
    )
    worker.put("ag-tok", {"route": "/tokenize", "body": {"prompt": PROMPT}})
    res_json, res_tool, res_resp, res_tok = _wait_done(
        worker, "ag-json", "ag-tool", "ag-resp", "ag-tok"
    )
    doc = json.loads(res_json["output"][0]["choices"][0]["message"]["content"])
    assert set(doc) == {"city", "n"} and doc["city"] in ("paris", "rome")
    choice = res_tool["output"][0]["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city", "n"}
    assert res_resp["output"][0]["object"] == "response"
    assert res_resp["output"][0]["output"][0]["content"][0]["type"] == "output_text"
    assert res_tok["output"][0]["count"] == len(res_tok["output"][0]["tokens"]) > 0


@pytest.mark.slow
def test_v2_24_route_jobs_answer_as_worker_vllm(worker, reference, smollm2_dir):
    """worker-vllm v2.24+'s `{"route", "body", "method"}`: a body POSTs, no body GETs; not
    streamed, the response object; streamed, SSE text; an error, the OpenAI error object (the SDK
    posts it as the job's error text)."""
    greedy = SamplingParams(temperature=0, max_tokens=8)
    ref_chat = reference.chat(MESSAGES, greedy)[0].outputs[0].text
    ref = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    chat = {"model": smollm2_dir, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    worker.put("rt-chat", {"route": "/v1/chat/completions", "body": chat})
    worker.put(
        "rt-stream",
        {"route": "/v1/chat/completions", "method": "POST", "body": {**chat, "stream": True}},
    )
    worker.put(
        "rt-completion",
        {
            "route": "/openai/v1/completions",
            "body": {"prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        },
    )
    worker.put("rt-models", {"route": "/v1/models"})
    worker.put("rt-get-chat", {"route": "/v1/chat/completions"})
    worker.put(
        "rt-tools",
        {"route": "/v1/chat/completions", "body": {**chat, "tools": [{"type": "function"}]}},
    )
    res_chat, res_stream, res_completion, res_models, res_get, res_tools = _wait_done(
        worker, "rt-chat", "rt-stream", "rt-completion", "rt-models", "rt-get-chat", "rt-tools"
    )
    assert res_chat["output"][0]["choices"][0]["message"]["content"] == ref_chat
    assert res_completion["output"][0]["choices"][0]["text"] == ref
    assert smollm2_dir in [m["id"] for m in res_models["output"][0]["data"]]
    events = [e[len("data: ") :] for e in "".join(res_stream["output"]).split("\n\n") if e]
    assert events[-1] == "[DONE]"
    deltas = [json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]]
    assert "".join(deltas) == ref_chat
    for result, param, words in (
        (res_get, "method", "GET"),
        (res_tools, "tools[0].function", "field required"),
    ):
        assert "output" not in result or not result["output"]
        assert f"'param': '{param}'" in result["error"] and words in result["error"], result


MALFORMED = {
    "bad-not-object": ("just a string", "input: must be an object"),
    "bad-prompt-type": ({"prompt": 5}, "input.prompt"),
    "bad-both": ({"prompt": "x", "messages": MESSAGES}, "exactly one of 'prompt' or 'messages'"),
    "bad-neither": ({"stream": True}, "exactly one of 'prompt' or 'messages'"),
    "bad-temperature": (
        {"prompt": "x", "sampling_params": {"temperature": -1}},
        "sampling_params.temperature",
    ),
    "bad-sampling-key": (
        {"prompt": "x", "sampling_params": {"temprature": 1}},
        "sampling_params.temprature",
    ),
    "bad-field": ({"promt": "x"}, "input.promt: unknown field"),
    "bad-route": ({"openai_route": "/v1/embeddings", "openai_input": {}}, "input.openai_route"),
    "bad-openai-input": (
        {"openai_route": "/v1/chat/completions", "openai_input": {"messages": "hi"}},
        "messages",
    ),
    "bad-too-long": (
        {"prompt": "hello " * 3000, "sampling_params": _greedy(8)},
        str(MAX_MODEL_LEN),
    ),
    "bad-max-tokens": (
        {"prompt": "x", "sampling_params": {"max_tokens": 10**9}},
        "input.sampling_params.max_tokens: ",
    ),
    "bad-surrogate": (
        {"messages": [{"role": "user", "content": "a\ud800"}]},
        "input.messages[0].content: invalid",
    ),
    "bad-tools": (
        {"messages": MESSAGES, "tools": [{"type": "function"}]},
        "input.tools[0].function: field required",
    ),
    "bad-oa-tool-choice": (
        {
            "openai_route": "/v1/chat/completions",
            "openai_input": {"messages": MESSAGES, "tool_choice": "required"},
        },
        "input.openai_input.tool_choice: needs tools",
    ),
    "bad-oa-missing": (
        {"openai_route": "/v1/chat/completions", "openai_input": {"max_tokens": 2}},
        "input.openai_input.messages: field required",
    ),
}


@pytest.mark.slow
def test_malformed_jobs_fail_alone_naming_the_field(worker, reference):
    for job_id, (job_input, _) in MALFORMED.items():
        worker.put(job_id, job_input)
    worker.put("good-after-bad", {"prompt": PROMPT, "sampling_params": _greedy(8)})
    results = dict(zip(MALFORMED, _wait_done(worker, *MALFORMED)))
    for job_id, (_, expected) in MALFORMED.items():
        assert "output" not in results[job_id] or not results[job_id]["output"], job_id
        assert expected in results[job_id]["error"], (job_id, results[job_id])
    # The prompt over the context limit names both numbers: its length and the limit.
    assert "3001" in results["bad-too-long"]["error"] or "3000" in results["bad-too-long"]["error"]
    (good,) = _wait_done(worker, "good-after-bad")
    ref = reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    assert good["output"][0]["choices"][0]["tokens"] == [ref]


@pytest.mark.slow
def test_the_sdk_under_test_is_the_version_asked_for(worker):
    """The SDK's process names its version in its job-takes' User-Agent: the one
    COLDBREW_RUNPOD_VERSION asks for (make test-clients-oldest, which names pyproject's floor:
    tests/test_packaging.py), else this interpreter's own."""
    wanted = os.environ.get("COLDBREW_RUNPOD_VERSION") or version("runpod")
    assert worker.user_agents, "no request from the SDK"
    assert {ua.split(" ")[0] for ua in worker.user_agents} == {f"RunPod-Python-SDK/{wanted}"}


@pytest.mark.slow
def test_every_job_got_exactly_one_result(worker):
    """Runs last in this module: no job was answered twice (the cancelled one is never answered)."""
    assert worker.done, "no job ran"
    assert {job_id: len(posts) for job_id, posts in worker.done.items() if len(posts) != 1} == {}
    assert worker.worker_ids == {"pod-main"}


@pytest.mark.slow
def test_sigterm_past_the_grace_period_ends_streams_with_an_error_then_exits_0(
    smollm2_dir, tmp_path
):
    """Past SHUTDOWN_GRACE_S the jobs in flight end: a worker-vllm batch stream with the job's
    error, an OpenAI SSE stream with an error event and [DONE] as its last batch (then the error);
    then the process exits 0."""
    count = "Count from one to a thousand:"
    with RunPodJobServer() as server:
        queue = server.queue
        proc = _start_worker(
            server, smollm2_dir, tmp_path / "worker.log", "pod-grace", SHUTDOWN_GRACE_S="1"
        )
        try:
            queue.put(
                "batches",
                {
                    "prompt": count,
                    "stream": True,
                    "sampling_params": _greedy(1500, ignore_eos=True),
                },
            )
            queue.put(
                "sse",
                {
                    "openai_route": "/v1/completions",
                    "openai_input": {
                        "prompt": count,
                        "stream": True,
                        "max_tokens": 1500,
                        "ignore_eos": True,
                    },
                },
            )
            both = lambda: queue.streams["batches"] and queue.streams["sse"]  # noqa: E731
            started = queue.wait_for(both, WAIT_S)
            assert started, (tmp_path / "worker.log").read_text()
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(WAIT_S)
        finally:
            stop(proc)
    log = (tmp_path / "worker.log").read_text()
    assert code == 0, log[-3000:]
    for job_id in ("batches", "sse"):
        (result,) = queue.done[job_id]
        assert "did not finish within 1s" in result["error"], result
    last = queue.streams["sse"][-1]["output"]
    assert last.endswith("data: [DONE]\n\n") and '"code": 503' in last
    assert "did not finish within 1s" in last
    assert queue.streams["batches"][-1]["output"]["usage"]["output"] < 1500


@pytest.mark.slow
def test_sigterm_drains_in_flight_jobs_and_takes_no_new_ones(smollm2_dir, reference, tmp_path):
    with RunPodJobServer() as server:
        queue = server.queue
        proc = _start_worker(server, smollm2_dir, tmp_path / "worker.log", "pod-drain")
        try:
            queue.put(
                "in-flight", {"prompt": PROMPT, "sampling_params": _greedy(12), "stream": True}
            )
            assert queue.wait_for(lambda: queue.streams["in-flight"], WAIT_S), (
                tmp_path / "worker.log"
            ).read_text()
            proc.send_signal(signal.SIGTERM)
            # A job-take poll already open when the signal lands may still return a job; give it
            # time to end.
            assert not queue.wait_for(
                lambda: proc.poll() is not None and not queue.done.get("in-flight"), 1.5
            )
            queue.put("after-sigterm", {"prompt": PROMPT, "sampling_params": _greedy(8)})
            assert proc.wait(WAIT_S) == 0, (tmp_path / "worker.log").read_text()[-3000:]
        finally:
            stop(proc)
        ref = (
            reference.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))[0]
            .outputs[0]
            .text
        )
        assert len(queue.done["in-flight"]) == 1
        assert _text(queue.done["in-flight"][0].get("output", [])) == ref, queue.done["in-flight"]
        assert "after-sigterm" not in queue.taken


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the process's children, from Linux's /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append((int(entry), cmdline))
    return out


def test_the_sdks_process_dying_ends_the_worker_with_status_1(smollm2_dir, tmp_path):
    """The RunPod SDK runs in a process of its own (handler.sdk_front); killed, nothing can reach
    the worker any more, so the worker exits 1 (the platform starts a new one) instead of living on
    unreachable. Killed with SIGKILL: no word from it, only the end of its socket."""
    with RunPodJobServer() as server:
        queue = server.queue
        proc = _start_worker(server, smollm2_dir, tmp_path / "worker.log", "pod-sdk-dies")
        try:
            queue.put("first", {"prompt": PROMPT, "sampling_params": _greedy(2)})
            assert queue.wait_for(lambda: queue.done.get("first"), WAIT_S), (
                tmp_path / "worker.log"
            ).read_text()[-3000:]
            sdk = [pid for pid, cmd in _children(proc.pid) if "handler.sdk_front" in cmd]
            assert len(sdk) == 1, _children(proc.pid)
            os.kill(sdk[0], signal.SIGKILL)
            code = proc.wait(WAIT_S)
        finally:
            stop(proc)
    log = (tmp_path / "worker.log").read_text()
    assert code == 1, log[-3000:]
    assert "the RunPod SDK's process ended" in log, log[-3000:]
