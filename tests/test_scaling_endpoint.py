"""The local endpoint emulator (scaling.endpoint) with real workers (`python -m handler`, the runpod
SDK loop) on loopback, driven by the official runpod and openai clients: a burst of 40 scales 0 ->
several workers -> 0, every job completes exactly once with engine.LLM's greedy output, and a
SIGKILLed worker's jobs are retried or failed explicitly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import requests
import runpod
import torch

from child_process import stop
from engine import LLM, SamplingParams
from scaling.endpoint import Endpoint, EndpointConfig

REPO = Path(__file__).resolve().parent.parent
MAX_MODEL_LEN = 512
MAX_WORKERS = 3
IDLE_S = 4.0
LEASE_TIMEOUT_S = 10.0  # workers ping every 2 s and poll every second; a frozen one is silent
WAIT_S = 240  # generous: CI shares 2 cores between the workers and the test
MESSAGES = [{"role": "user", "content": "Name a fruit that is yellow."}]
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT")


def _greedy(max_tokens: int, **extra) -> dict:
    return {"temperature": 0, "max_tokens": max_tokens, **extra}


def _text(output: list[dict]) -> str:
    return "".join("".join(batch["choices"][0]["tokens"]) for batch in output)


def _wait_for(predicate, timeout: float = WAIT_S, what: str = "condition", poll_s: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture(scope="module")
def endpoint(smollm2_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("endpoint-workers")
    config = EndpointConfig(
        port=0,
        max_workers=MAX_WORKERS,
        idle_s=IDLE_S,
        rate_window_s=5.0,
        cold_start_s=10.0,
        log_dir=str(log_dir),
        lease_timeout_s=LEASE_TIMEOUT_S,
        worker_env={
            "MODEL_NAME": smollm2_dir,
            "DEVICE": "cpu",
            "MAX_MODEL_LEN": str(MAX_MODEL_LEN),
            "MAX_CONCURRENCY": "4",
            "OMP_NUM_THREADS": "1",
            "LOG_LEVEL": "WARNING",
        },
    )
    ep = Endpoint(config).start()
    try:
        yield ep
    finally:
        ep.stop()
        for log_path in sorted(log_dir.glob("*.log")):  # shown by pytest only when a test failed
            print(f"--- {log_path.name}\n{log_path.read_text(errors='replace')[-3000:]}")


@pytest.fixture
def client(endpoint, monkeypatch):
    """The runpod SDK's own endpoint client, pointed at the emulator."""
    monkeypatch.setattr(runpod, "api_key", "local-key")
    monkeypatch.setattr(runpod, "endpoint_url_base", f"{endpoint.url}/v2")
    return runpod.Endpoint(endpoint.config.endpoint_id)


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    # One thread: this process shares the cores with the workers, and torch's thread pool spins
    # badly when crowded.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM(model=smollm2_dir, max_model_len=MAX_MODEL_LEN, device="cpu")
    finally:
        torch.set_num_threads(threads)


def test_cli_serves_health_and_stops_on_sigterm():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "scaling.endpoint",
            "--port",
            "0",
            "--max-workers",
            "1",
            "--idle-s",
            "5",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        # "coldbrew local endpoint: http://127.0.0.1:PORT/v2/local  (OpenAI: ...)"
        line = proc.stdout.readline()
        base = line.split()[3]
        assert base.startswith("http://127.0.0.1:") and base.endswith("/v2/local"), line
        health = requests.get(f"{base}/health").json()
        assert health["workers"]["ready"] == 0 and health["jobs"]["inQueue"] == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        stop(proc)
    bad = subprocess.run(
        [sys.executable, "-m", "scaling.endpoint", "--max-workers", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        bad.returncode == 2
        and "--max-workers: must be in [max(1, min_workers), 256], got 0" in bad.stderr
    )


def test_bad_requests_name_the_field(endpoint):
    base = endpoint.base
    cases = [
        (requests.post(f"{base}/run", data=b"{not json"), 400, "body: invalid JSON"),
        (requests.post(f"{base}/run", json=[1, 2]), 400, "body: must be a JSON object"),
        (requests.post(f"{base}/run", json={"prompt": "x"}), 400, "prompt: unknown field"),
        (requests.post(f"{base}/run", json={}), 400, "input: required"),
        (
            requests.post(f"{base}/run", json={"input": {}, "webhook": "http://x"}),
            400,
            "webhook: not supported",
        ),
        (
            requests.post(f"{base}/runsync?wait=5", json={"input": {}}),
            400,
            "wait: must be an integer",
        ),
        (requests.get(f"{base}/status/no-such-job"), 404, "no-such-job"),
        (
            requests.post(f"{endpoint.url}/v2/other/run", json={"input": {}}),
            404,
            "endpoint 'other' not found",
        ),
        (requests.get(f"{base}/job-take/worker-1?token=wrong"), 401, "token"),
    ]
    for response, status, message in cases:
        assert response.status_code == status, response.text
        assert message in response.json()["error"], response.text
    bad_openai = requests.post(f"{base}/openai/v1/embeddings", json={"input": "x"})
    assert (
        bad_openai.status_code == 404
        and "/openai/v1/chat/completions" in bad_openai.json()["error"]["message"]
    )
    # None of these created a job or started a worker.
    assert endpoint.queue.jobs == {} and endpoint.pool.pids == {}


@pytest.mark.slow
def test_workers_that_cannot_start_fail_the_queued_job_with_their_error(tmp_path):
    config = EndpointConfig(
        port=0,
        max_workers=1,
        idle_s=IDLE_S,
        log_dir=str(tmp_path),
        max_boot_failures=2,
        worker_env={
            "MODEL_NAME": str(tmp_path / "no-such-model"),
            "DEVICE": "cpu",
            "OMP_NUM_THREADS": "1",
        },
    )
    with Endpoint(config) as ep:
        result = requests.post(
            f"{ep.base}/runsync?wait=200000",
            timeout=WAIT_S,
            json={"input": {"prompt": "hi", "sampling_params": _greedy(4)}},
        ).json()
        assert result["status"] == "FAILED"
        assert (
            "workers fail to start (2 in a row)" in result["error"]
            and "no-such-model" in result["error"]
        )
        assert ep.health()["jobs"]["failed"] == 1 and len(ep.pool.pids) == 2


@pytest.mark.slow
def test_burst_scales_out_from_zero_and_every_job_completes_once(endpoint, client, reference):
    health = client.health()
    assert health["workers"]["ready"] == health["workers"]["initializing"] == 0
    prompts = [f"Write one word about the number {i}:" for i in range(40)]
    jobs = [client.run({"prompt": p, "sampling_params": _greedy(6)}) for p in prompts]
    cancelled = client.run({"prompt": "never runs", "sampling_params": _greedy(6)})
    assert cancelled.cancel()["status"] == "CANCELLED"

    most_workers = 0

    def all_final() -> bool:
        nonlocal most_workers
        workers = client.health()["workers"]
        most_workers = max(most_workers, workers["initializing"] + workers["ready"])
        return all(job.status() in FINAL for job in jobs)

    _wait_for(all_final, what="40 jobs to finish")
    assert 1 < most_workers <= MAX_WORKERS
    assert [job.status() for job in jobs] == ["COMPLETED"] * 40
    # Each job got its own prompt's answer: the worker's output equals engine.LLM's greedy one, all
    # 40 of them.
    refs = reference.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    assert [_text(job.output()) for job in jobs] == [r.outputs[0].text for r in refs]
    assert [job.output()[-1]["usage"]["output"] for job in jobs] == [
        len(r.outputs[0].token_ids) for r in refs
    ]
    # Exactly once: one result posted per job, none for the cancelled one, and the counts agree.
    assert [endpoint.queue.jobs[job.job_id].done_posts for job in jobs] == [1] * 40
    assert endpoint.queue.jobs[cancelled.job_id].done_posts == 0
    assert client.health()["jobs"] == {
        "completed": 40,
        "failed": 0,
        "inProgress": 0,
        "inQueue": 0,
        "retried": 0,
    }
    # The shape of RunPod's /status for a finished job.
    status = requests.get(f"{endpoint.base}/status/{jobs[0].job_id}").json()
    assert (
        status["status"] == "COMPLETED"
        and status["delayTime"] >= 0
        and status["executionTime"] >= 0
    )


@pytest.mark.slow
def test_openai_client_plain_and_streaming(endpoint, reference, smollm2_dir):
    oai = openai.OpenAI(
        base_url=f"{endpoint.base}/openai/v1", api_key="local-key", max_retries=0, timeout=WAIT_S
    )
    ref = reference.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    plain = oai.chat.completions.create(
        model=smollm2_dir, messages=MESSAGES, max_tokens=8, temperature=0
    )
    assert plain.choices[0].message.content == ref
    assert plain.usage.completion_tokens == 8
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in oai.chat.completions.create(
            model=smollm2_dir, messages=MESSAGES, max_tokens=8, temperature=0, stream=True
        )
        if chunk.choices
    ]
    assert len(pieces) > 2 and "".join(pieces) == ref
    assert smollm2_dir in [m.id for m in oai.models.list().data]
    for stream in (False, True):  # refused before any output: an OpenAI-shaped 400 naming the model
        with pytest.raises(openai.BadRequestError, match="does not exist"):
            oai.chat.completions.create(
                model="no-such-model", messages=MESSAGES, max_tokens=8, stream=stream
            )


@pytest.mark.slow
def test_killed_worker_job_is_retried_or_failed_never_lost(endpoint, client, reference):
    jobs = endpoint.queue.jobs
    before = client.health()["jobs"]
    # A job nobody has read from yet: its worker is SIGKILLed after the first streamed chunk; it
    # runs again elsewhere.
    prompt = "Count from one to a thousand:"
    unseen = client.run(
        {"prompt": prompt, "sampling_params": _greedy(80, ignore_eos=True), "stream": True}
    )
    _wait_for(lambda: jobs[unseen.job_id].stream, what="the first job to stream", poll_s=0.02)
    killed = jobs[unseen.job_id].worker_id
    os.kill(endpoint.pool.pids[killed], signal.SIGKILL)
    _wait_for(lambda: unseen.status() in FINAL, what="the first job to end")
    assert unseen.status() == "COMPLETED"
    ref = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))[
        0
    ]
    # the whole greedy answer, posted once, by another worker
    assert _text(unseen.output()) == ref.outputs[0].text
    assert jobs[unseen.job_id].worker_id != killed and jobs[unseen.job_id].done_posts == 1

    # A job a client has partly read through /stream: a rerun would show its start twice, so it
    # fails explicitly.
    seen = client.run(
        {
            "prompt": "List the days of the week:",
            "stream": True,
            "sampling_params": _greedy(400, ignore_eos=True),
        }
    )
    _wait_for(lambda: jobs[seen.job_id].stream, what="the second job to stream", poll_s=0.02)
    partial = requests.get(f"{endpoint.base}/stream/{seen.job_id}").json()
    assert partial["status"] == "IN_PROGRESS" and partial["stream"]
    killed = jobs[seen.job_id].worker_id
    os.kill(endpoint.pool.pids[killed], signal.SIGKILL)
    _wait_for(lambda: seen.status() in FINAL, what="the second job to end")
    failed = requests.get(f"{endpoint.base}/status/{seen.job_id}").json()
    assert (
        failed["status"] == "FAILED"
        and killed in failed["error"]
        and "not retried" in failed["error"]
    )
    after = client.health()["jobs"]
    assert (after["retried"] - before["retried"], after["failed"] - before["failed"]) == (1, 1)


@pytest.mark.slow
def test_frozen_worker_loses_its_lease_and_the_job_runs_elsewhere(endpoint, client, reference):
    """A worker that stops answering (SIGSTOP on its whole process group, heartbeat included) is
    killed by the endpoint after the lease timeout, and the job it held runs again on another
    worker."""
    jobs = endpoint.queue.jobs
    before = client.health()["jobs"]["retried"]
    prompt = "Name three rivers:"
    job = client.run(
        {"prompt": prompt, "sampling_params": _greedy(40, ignore_eos=True), "stream": True}
    )
    _wait_for(lambda: jobs[job.job_id].stream, what="the job to stream", poll_s=0.02)
    frozen = jobs[job.job_id].worker_id
    os.killpg(endpoint.pool.pids[frozen], signal.SIGSTOP)
    _wait_for(lambda: job.status() in FINAL, what="the job to end")
    assert job.status() == "COMPLETED" and jobs[job.job_id].worker_id != frozen
    ref = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[
        0
    ]
    assert _text(job.output()) == ref.outputs[0].text
    assert client.health()["jobs"]["retried"] == before + 1
    # the endpoint killed it (SIGKILL ends a stopped process)
    assert frozen not in endpoint.pool.workers


@pytest.mark.slow
def test_cancel_stops_a_running_job_and_its_worker_goes_on(endpoint, client, reference):
    jobs = endpoint.queue.jobs
    job = client.run(
        {
            "prompt": "Count from one to a thousand:",
            "stream": True,
            "sampling_params": _greedy(400, ignore_eos=True),
        }
    )
    _wait_for(lambda: jobs[job.job_id].stream, what="the job to stream", poll_s=0.02)
    worker = endpoint.pool.workers[jobs[job.job_id].worker_id]
    _wait_for(lambda: job.job_id in worker.ping_jobs, what="the worker's heartbeat to list the job")
    assert job.cancel()["status"] == "CANCELLED"
    pings = worker.pings
    # The stop reached the worker through its job-stop poll: its heartbeat stops listing the job, it
    # posts no result.
    _wait_for(
        lambda: worker.pings > pings and job.job_id not in worker.ping_jobs,
        what="the worker to drop the job",
    )
    assert jobs[job.job_id].done_posts == 0 and worker.state == "ready"
    assert requests.get(f"{endpoint.base}/status/{job.job_id}").json()["status"] == "CANCELLED"
    after = client.run_sync(
        {"prompt": "The capital of France is", "sampling_params": _greedy(6)}, timeout=WAIT_S
    )
    ref = reference.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=6)
    )[0]
    assert _text(after) == ref.outputs[0].text


@pytest.mark.slow
def test_scales_back_to_zero_when_idle(endpoint, client):
    """Runs last: with nothing to do every worker is drained after the keep-alive and its processes
    are gone."""

    def all_gone() -> bool:
        workers = client.health()["workers"]
        return (
            not endpoint.pool.workers
            and sum(workers[k] for k in ("initializing", "ready", "draining")) == 0
        )

    _wait_for(all_gone, timeout=120, what="zero workers")
    assert client.health()["jobs"]["inQueue"] == client.health()["jobs"]["inProgress"] == 0
    # the burst and the replacements after the kill
    assert len(endpoint.pool.pids) > MAX_WORKERS - 1

    def group_gone(pid: int) -> bool:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        return False

    # Each worker and its process group (the SDK's heartbeat child included) ended; init reaps the
    # orphans.
    _wait_for(
        lambda: all(group_gone(pid) for pid in endpoint.pool.pids.values()),
        timeout=60,
        what="every worker process group to end",
    )
