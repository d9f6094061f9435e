"""What a worker reports to a scaler, on the real engine with SmolLM2: each job's final output
carries its queue wait (the cold start included when the job came first), the worker's capacity and
its boot phases; /metrics has the same.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import time

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from starlette.testclient import TestClient

from handler.admission import Admission
from handler.config import load_settings
from handler.engine_boot import EngineBoot
from handler.server import build_app
from handler.worker import Worker
from warmup.start import process_age_s as _process_age_s

GREEDY = {"temperature": 0, "max_tokens": 6}


@pytest.fixture(scope="module")
def cold(smollm2_dir):
    """A worker whose engine is not loaded yet, and the first job it got (it waits for the whole
    boot)."""
    settings = load_settings(
        {
            "MODEL_NAME": smollm2_dir,
            "MAX_MODEL_LEN": "1024",
            "DEVICE": "cpu",
            "MAX_CONCURRENCY": "50",
        }
    )
    boot = EngineBoot(settings)  # not started: the first job starts the load, as at a cold start
    admission = Admission(
        settings.max_concurrency,
        boot,
        occupancy=lambda: len(admission.tickets),
        exit_fn=lambda code: None,
    )
    worker = Worker(settings, boot, admission)

    async def first_job():
        t0 = time.time()
        job = {"id": "first", "input": {"prompt": "Hello", "sampling_params": GREEDY}}
        chunks = [c async for c in worker.handle(job)]
        return chunks, time.time() - t0

    chunks, elapsed = asyncio.run(first_job())
    yield worker, chunks, elapsed
    boot.engine_now().shutdown()


def _run(worker: Worker, job_input: dict, job_id: str = "job") -> list:
    async def collect():
        return [c async for c in worker.handle({"id": job_id, "input": job_input})]

    return asyncio.run(collect())


def test_a_job_taken_during_the_cold_start_reports_the_boot_as_its_queue_wait(cold):
    worker, chunks, elapsed = cold
    phases = worker.boot.phases
    assert len(chunks) == 1 and "error" not in chunks[0], chunks
    m = chunks[0]["metrics"]
    # It waited for the whole boot: at least the boot's own total, at most the job's whole time in
    # the handler.
    assert (
        phases["total"] - 0.002
        <= m["engine_wait_s"]
        <= m["queue_wait_s"]
        <= m["time_to_first_token_s"]
    )
    assert m["time_to_first_token_s"] <= elapsed + 0.002
    # The cold start counts from process start: the boot itself plus what came before it (here: the
    # test run).
    assert m["cold_start_s"] == round(phases["total"] + phases["before_boot"], 3)
    assert 0 < phases["before_boot"] <= _process_age_s()
    assert set(m["cold_start_phases"]) == set(phases) - {"total"} and {"resolve", "engine"} <= set(
        phases
    )
    # The rest of the output is worker-vllm's, unchanged.
    assert chunks[0]["usage"] == {"input": chunks[0]["usage"]["input"], "output": 6}
    assert chunks[0]["choices"][0]["finish_reason"] == "length"


def test_a_warm_job_reports_a_short_wait_and_the_capacity_free_blocks_give(cold):
    worker, _, _ = cold
    adm = worker.admission
    engine = worker.boot.engine_now()
    t0 = time.time()
    out = _run(worker, {"prompt": "The sky is", "sampling_params": GREEDY}, "warm")[-1]
    elapsed = time.time() - t0
    m = out["metrics"]
    assert m["engine_wait_s"] == 0.0
    assert 0.0 <= m["queue_wait_s"] <= m["time_to_first_token_s"] <= elapsed + 0.002
    # Capacity: the job itself (still held when its result is made) plus typical requests in the
    # free blocks.
    stats = engine.stats()
    block = worker.settings.block_size
    typical_blocks = math.ceil(adm.typical_tokens / block)
    assert m["capacity_requests"] == min(
        worker.settings.max_concurrency, 1 + stats.num_free_blocks // typical_blocks
    )
    # It follows the size of the requests served: after many short ones, more of them fit.
    before = adm.capacity()
    for _ in range(40):
        adm.observe(4, 4)
    assert adm.capacity() > before or adm.capacity() == worker.settings.max_concurrency


def test_streamed_jobs_carry_metrics_on_the_last_chunk_only(cold):
    worker, _, _ = cold
    chunks = _run(
        worker,
        {
            "prompt": "Count: one, two,",
            "stream": True,
            "sampling_params": {"temperature": 0, "max_tokens": 12, "ignore_eos": True},
        },
    )
    assert len(chunks) >= 3
    assert all("metrics" not in c for c in chunks[:-1])
    assert (
        chunks[-1]["metrics"]["queue_wait_s"] >= 0
        and chunks[-1]["choices"][0]["finish_reason"] == "length"
    )


def test_openai_route_outputs_stay_valid_for_the_official_client(cold, smollm2_dir):
    worker, _, _ = cold
    chat = {
        "model": smollm2_dir,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "temperature": 0,
    }
    whole = _run(worker, {"openai_route": "/v1/chat/completions", "openai_input": chat})
    assert len(whole) == 1
    parsed = ChatCompletion.model_validate(whole[0])  # the openai package's own response type
    assert parsed.usage.completion_tokens == 5
    assert (
        whole[0]["metrics"]["queue_wait_s"] >= 0
        and whole[0]["metrics"]["time_to_first_token_s"] > 0
    )
    completion = _run(
        worker,
        {
            "openai_route": "/openai/v1/completions",
            "openai_input": {
                "model": smollm2_dir,
                "prompt": "Hi",
                "max_tokens": 3,
                "temperature": 0,
            },
        },
    )
    assert Completion.model_validate(completion[0]).usage.completion_tokens == 3
    assert completion[0]["metrics"]["capacity_requests"] >= 1
    # Streamed: chunks stay exactly the OpenAI stream (SSE lines of chunk objects, then [DONE]); no
    # metrics in it.
    streamed = "".join(
        _run(
            worker,
            {"openai_route": "/v1/chat/completions", "openai_input": {**chat, "stream": True}},
        )
    )
    events = [e[len("data: ") :] for e in streamed.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        ChatCompletionChunk.model_validate(json.loads(event))
    assert "metrics" not in streamed
    # Models listing: no completion, no metrics.
    assert "metrics" not in _run(worker, {"openai_route": "/v1/models"})[0]


def test_process_age_agrees_with_ps():
    ps = subprocess.run(
        ["ps", "-o", "etimes=", "-p", str(os.getpid())], capture_output=True, text=True
    )
    if ps.returncode != 0 or not ps.stdout.strip().isdigit():
        pytest.skip("no procps ps here")
    assert abs(_process_age_s() - int(ps.stdout)) <= 1.5  # ps rounds down to whole seconds


def _value(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


def test_metrics_endpoint_reports_capacity_cold_start_and_queue_wait(cold, smollm2_dir):
    worker, _, _ = cold
    boot = worker.boot
    # no lifespan: the module's engine stays up
    client = TestClient(build_app(worker.settings, boot))
    before = client.get("/metrics").text
    assert _value(before, "coldbrew_queue_wait_seconds_count") == 0
    r = client.post(
        "/v1/completions",
        json={"model": smollm2_dir, "prompt": ["a", "b", "c"], "max_tokens": 2, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    text = client.get("/metrics").text
    # One queue-wait observation per engine request (three prompts), each within the request's own
    # latency.
    assert _value(text, "coldbrew_queue_wait_seconds_count") == 3
    waited = _value(text, "coldbrew_queue_wait_seconds_sum")
    assert 0 <= waited <= 3 * _value(text, "coldbrew_request_latency_seconds_sum")
    buckets = [
        float(v)
        for v in re.findall(r'^coldbrew_queue_wait_seconds_bucket\{le="[^"]+"\} (\S+)$', text, re.M)
    ]
    assert buckets == sorted(buckets) and buckets[-1] == 3  # cumulative, +Inf holds them all
    # Cold start: every boot phase as a labelled gauge, the same seconds the boot measured.
    for phase, seconds in boot.phases.items():
        assert _value(text, "coldbrew_cold_start_seconds", f'{{phase="{phase}"}}') == pytest.approx(
            seconds
        )
    # Capacity: nothing running now, so as many typical requests as the free blocks hold (bounded by
    # MAX_NUM_SEQS).
    stats = boot.engine_now().stats()
    typical = _value(text, "coldbrew_typical_request_tokens")
    per_request = math.ceil(typical / worker.settings.block_size)
    expected = min(worker.settings.max_num_seqs, stats.num_free_blocks // per_request)
    assert _value(text, "coldbrew_capacity_requests") == expected
    assert typical < 1024  # three small requests moved the typical size down from its seed


def test_queue_wait_counts_the_engine_queue(smollm2_dir):
    """With one sequence at a time, of two jobs sent together the second waits in the engine until
    the first ends."""
    settings = load_settings(
        {"MODEL_NAME": smollm2_dir, "MAX_MODEL_LEN": "512", "DEVICE": "cpu", "MAX_NUM_SEQS": "1"}
    )
    boot = EngineBoot(settings)
    boot.load_blocking()
    worker = Worker(settings, boot, Admission(settings.max_concurrency, boot, occupancy=lambda: 0))
    job = {
        "prompt": "Once upon a time",
        "sampling_params": {"temperature": 0, "max_tokens": 16, "ignore_eos": True},
    }

    async def both():
        async def one(job_id):
            return [c async for c in worker.handle({"id": job_id, "input": job})][-1]["metrics"]

        return await asyncio.gather(one("a"), one("b"))

    try:
        first, second = sorted(asyncio.run(both()), key=lambda m: m["queue_wait_s"])
    finally:
        boot.engine_now().shutdown()
    assert first["engine_wait_s"] == second["engine_wait_s"] == 0.0
    # The second was scheduled only once the first had finished, so after the first's first token.
    assert second["queue_wait_s"] > first["time_to_first_token_s"] >= first["queue_wait_s"]
