"""The worker off RunPod: `--rp_serve_api` (what `make run` starts) answers /runsync from the SDK's
own local API and its printed curl line works; `--test_input` runs one job. Answers are checked
against engine.LLM.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from child_process import repo_pythonpath
from engine import LLM, SamplingParams
from local_api import local_api as worker_local_api, runsync

REPO = Path(__file__).resolve().parent.parent
WAIT_S = 240


def _printed_curl(lines: list[str]) -> str | None:
    """The curl line printed after "coldbrew: model ready", once it is there."""
    ready = [i for i, line in enumerate(lines) if line.startswith("coldbrew: model ready")]
    after = (
        [line for line in lines[ready[0] :] if line.strip().startswith("curl ")] if ready else []
    )
    return after[0].strip() if after else None


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def local_api(smollm2_dir, cache_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNPOD_")}
    env.update(
        CACHE_DIR=str(cache_dir),
        MODEL_NAME=smollm2_dir,
        MAX_MODEL_LEN="2048",
        DEVICE="cpu",
        PYTHONPATH=repo_pythonpath(),
        UVICORN_LOG_LEVEL="warning",
    )
    lines: list[str] = []
    argv = [sys.executable, "-m", "handler"]
    with worker_local_api(argv, REPO, env, until=_printed_curl, output=lines) as base:
        yield base, _printed_curl(lines)


def _runsync(base: str, job_input) -> dict:
    return runsync(base, job_input)[1]


@pytest.mark.slow
def test_printed_curl_line_works(local_api, smollm2_dir):
    base, curl = local_api
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    argv = shlex.split(curl)
    assert argv[0] == "curl" and f"{base}/runsync" in argv
    answer = json.loads(
        subprocess.run(argv, capture_output=True, text=True, timeout=WAIT_S, check=True).stdout
    )
    job = json.loads(argv[argv.index("-d") + 1])["input"]
    ref = (
        LLM(model=smollm2_dir, max_model_len=2048, device="cpu")
        .generate(job["prompt"], SamplingParams(**job["sampling_params"]))[0]
        .outputs[0]
    )
    assert answer["status"] == "COMPLETED"
    assert answer["output"][0]["choices"][0]["tokens"] == [ref.text]


@pytest.mark.slow
def test_runsync_serves_both_job_shapes_and_survives_bad_input(local_api, smollm2_dir):
    base, _ = local_api
    bad = _runsync(base, {"prompt": "hi", "sampling_params": {"top_p": 2}})
    assert "sampling_params.top_p" in bad["output"][0]["error"]
    chat = _runsync(
        base,
        {
            "openai_route": "/v1/chat/completions",
            "openai_input": {
                "model": smollm2_dir,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8,
                "temperature": 0,
            },
        },
    )
    ref = (
        LLM(model=smollm2_dir, max_model_len=2048, device="cpu")
        .chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=8))[0]
        .outputs[0]
        .text
    )
    assert chat["status"] == "COMPLETED"
    assert chat["output"][0]["choices"][0]["message"]["content"] == ref


@pytest.mark.slow
def test_runsync_serves_the_v2_24_route_form(local_api, smollm2_dir):
    """worker-vllm v2.24+'s `{"route", "body", "method"}` through the SDK's local API: the response
    object, the model list for a body-less GET, and an OpenAI error object (in the output, as the
    local API keeps it) for tools without a parser, and a named tool call."""
    base, _ = local_api
    parts = [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]
    messages = [{"role": "user", "content": parts}]
    chat = _runsync(
        base,
        {
            "route": "/v1/chat/completions",
            "method": "POST",
            "body": {"messages": messages, "max_tokens": 8, "temperature": 0},
        },
    )
    ref = (
        LLM(model=smollm2_dir, max_model_len=2048, device="cpu")
        .chat(messages, SamplingParams(temperature=0, max_tokens=8))[0]
        .outputs[0]
        .text
    )
    assert chat["status"] == "COMPLETED"
    assert chat["output"][0]["choices"][0]["message"]["content"] == ref
    # The same conversation as a messages job means the same prompt: the text parts joined as the
    # template joins them.
    as_job = _runsync(
        base, {"messages": messages, "sampling_params": {"max_tokens": 8, "temperature": 0}}
    )
    assert as_job["output"][0]["choices"][0]["tokens"] == [ref]
    models = _runsync(base, {"route": "/v1/models"})
    assert smollm2_dir in [m["id"] for m in models["output"][0]["data"]]
    tools = _runsync(
        base,
        {
            "route": "/v1/chat/completions",
            "body": {
                "messages": messages,
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
        },
    )
    error = tools["output"][0]["error"]
    assert (error["code"], error["param"], error["type"]) == (400, "tools", "invalid_request_error")
    assert "needs TOOL_CALL_PARSER" in error["message"]
    tool = {"type": "function", "function": {"name": "f"}}
    named = _runsync(
        base,
        {
            "route": "/v1/chat/completions",
            "body": {
                "messages": messages,
                "max_tokens": 32,
                "tools": [tool],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
        },
    )
    choice = named["output"][0]["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["f"]
    job_tools = _runsync(base, {"messages": messages, "tools": [tool]})
    assert job_tools["output"][0]["error"].startswith('input.tools: tool_choice "auto"')


@pytest.mark.slow
def test_test_input_runs_one_job_and_exits(smollm2_dir):
    """Off RunPod, `--test_input JSON` (the SDK's flag) runs that one job and prints its result."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNPOD_")}
    env.update(
        MODEL_NAME=smollm2_dir,
        MAX_MODEL_LEN="2048",
        DEVICE="cpu",
        PYTHONPATH=repo_pythonpath(),
        LOG_LEVEL="WARNING",
    )
    job = {
        "input": {
            "messages": [{"role": "user", "content": "hi"}],
            "sampling_params": {"max_tokens": 8, "temperature": 0},
        }
    }
    done = subprocess.run(
        [sys.executable, "-m", "handler", "--test_input", json.dumps(job)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    ref = (
        LLM(model=smollm2_dir, max_model_len=2048, device="cpu")
        .chat(job["input"]["messages"], SamplingParams(temperature=0, max_tokens=8))[0]
        .outputs[0]
        .text
    )
    assert result["output"][0]["choices"][0]["tokens"] == [ref]
    bad = subprocess.run(
        [sys.executable, "-m", "handler", "--test_input", '{"input": {"prompt": 1}}'],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert (
        bad.returncode == 1
        and "input.prompt" in json.loads(bad.stdout.strip().splitlines()[-1])["error"]
    )


@pytest.mark.slow
def test_the_local_apis_start_pages_are_its_own_and_hold_the_sdks_web_server(local_api, cache_dir):
    from cache import start_pages

    base, _ = local_api
    assert _runsync(base, {"prompt": "hi", "sampling_params": {"max_tokens": 1}})["output"]
    # written once the SDK's loop has sent its files (at its first job) and the engine is ready
    record = Path(start_pages.default_path(str(cache_dir), "worker-api"))
    deadline = time.monotonic() + 30
    while not record.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    names = [name for name, _ in json.loads(record.read_text())["files"]]
    # the SDK's local API runs FastAPI in the SDK's process; the job queue's loop does not
    assert any(f"{os.sep}fastapi{os.sep}" in n for n in names), names[:20]
    assert not Path(start_pages.default_path(str(cache_dir), "worker")).exists()
