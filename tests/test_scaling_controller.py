"""`python -m scaling.controller` against a local stand-in of the RunPod API
(tests/runpod_api_server.py), itself checked against the real runpod SDK's client: dry runs change
nothing, live runs send the documented update with the key in the Authorization header only; a
refused key, an API that is down or silent end in a clear error, never a hang.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import runpod

from scaling.controller import ArrivalMeter, Controller, recommend
from scaling.policy import PolicyConfig
from scaling.runpod_api import EndpointHealth, RunPodApi, RunPodApiError
from tests.runpod_api_server import RunPodApiServer, health_body

REPO = Path(__file__).resolve().parent.parent
KEY = "rpa_TESTKEY_0123456789abcdef"
ENDPOINT = "abc123xyz"


@pytest.fixture
def api():
    with RunPodApiServer(KEY, ENDPOINT, workers_max=3) as server:
        yield server


def _controller(
    *args: str, key: str | None = KEY, timeout: float = 60
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RUNPOD_API_KEY"}
    if key is not None:
        env["RUNPOD_API_KEY"] = key
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "scaling.controller", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _bases(server: RunPodApiServer) -> list[str]:
    return ["--api-base", server.queue_api, "--rest-base", server.rest_api]


def test_the_stand_in_answers_the_real_sdk_client(api, monkeypatch):
    """The runpod SDK's own Endpoint.health() (its URL form and auth header) gets RunPod's
    documented shape."""
    monkeypatch.setattr(runpod, "endpoint_url_base", api.queue_api)
    api.health_script = [health_body(in_queue=2, completed=1, failed=5, idle=1)]
    assert runpod.Endpoint(ENDPOINT, api_key=KEY).health() == api.health_script[0]
    with pytest.raises(RuntimeError, match="(?i)unauthorized"):
        runpod.Endpoint(ENDPOINT, api_key="wrong").health()


def test_dry_run_prints_decisions_and_changes_nothing(api):
    api.health_script = [
        health_body(),
        health_body(in_queue=20),
        health_body(in_queue=20, in_progress=4, running=1),
    ]
    run = _controller(
        "--endpoint",
        ENDPOINT,
        "--dry-run",
        "--iterations",
        "3",
        "--interval",
        "0.05",
        "--capacity",
        "8",
        *_bases(api),
    )
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stdout.splitlines() if "[dry-run]" in line]
    assert len(lines) == 3, run.stdout
    assert '{"workersMin": 0}' in lines[0]  # nothing queued, nothing arriving: no worker held
    burst = int(lines[1].split('"workersMin": ')[1].split("}")[0])
    # scaled up at once, within the endpoint's workersMax (read from the API)
    assert 1 <= burst <= 3
    assert api.updates() == []  # a dry run sends no update
    assert [r["method"] for r in api.requests] == [
        "GET"
    ] * 4  # the endpoint read, then three /health polls
    assert KEY not in run.stdout + run.stderr


def test_live_run_sends_the_update_with_the_key_in_the_header_only(api):
    api.health_script = [health_body(), health_body(in_queue=12)]
    run = _controller(
        "--endpoint",
        ENDPOINT,
        "--iterations",
        "2",
        "--interval",
        "0.05",
        "--capacity",
        "4",
        "--max-workers",
        "2",
        "--apply-max",
        "--apply-idle-timeout",
        "--cold-start",
        "45",
        *_bases(api),
    )
    assert run.returncode == 0, run.stderr
    updates = api.updates()
    assert [u["method"] for u in updates] == ["PATCH", "PATCH"]
    for u in updates:
        assert u["path"] == f"/v1/endpoints/{ENDPOINT}"
        assert u["headers"]["Authorization"] == f"Bearer {KEY}"
        assert u["headers"]["Content-Type"] == "application/json"
        assert KEY not in u["path"] and KEY not in str(u["body"])
        assert (
            set(u["body"]) == {"workersMin", "workersMax", "idleTimeout"}
            and u["body"]["workersMax"] == 2
        )
        assert 1 <= u["body"]["idleTimeout"] <= 3600
    assert updates[0]["body"]["workersMin"] == 0 and updates[1]["body"]["workersMin"] == 2
    assert api.endpoint["workersMin"] == 2  # the stand-in applied it, as RunPod would
    assert all(r["headers"]["Authorization"] == f"Bearer {KEY}" for r in api.requests)
    assert KEY not in run.stdout + run.stderr


def test_in_process_controller_applies_only_changes_and_scales_back_to_zero(api):
    now = [1000.0]
    lines: list[str] = []
    client = RunPodApi(KEY, ENDPOINT, queue_api=api.queue_api, rest_api=api.rest_api, timeout_s=5)
    controller = Controller(
        client,
        PolicyConfig(max_workers=3),
        capacity=4,
        cold_start_s=30,
        out=lines.append,
        clock=lambda: now[0],
    )
    api.health_script = [
        health_body(),
        health_body(in_queue=10),
        health_body(in_queue=10),
        health_body(completed=10, idle=2),
        health_body(completed=10, idle=2),
    ]
    actions = []
    for dt in (0, 5, 5, 60, 3600):  # idle, a burst, the same burst, done, then an hour with nothing
        now[0] += dt
        decision, body, action = controller.step()
        actions.append((body["workersMin"], action))
    assert actions[0] == (0, "applied")  # nothing known of the endpoint: the first decision is sent
    assert actions[1][0] >= 1 and actions[1][1] == "applied"
    assert actions[2] == (actions[1][0], "unchanged")  # no call when nothing changes
    assert actions[-1] == (0, "applied")  # idle far past any keep-alive: back to zero
    assert [u["body"]["workersMin"] for u in api.updates()] == [
        a[0] for a in actions if a[1] == "applied"
    ]
    assert len(lines) == 5 and KEY not in "".join(lines)
    # Started against an endpoint already at the value it decides: nothing to send.
    sent = len(api.updates())
    dry = Controller(
        client,
        PolicyConfig(max_workers=3),
        capacity=4,
        cold_start_s=30,
        out=lines.append,
        dry_run=True,
    )
    wanted = dry.step()[1]
    again = Controller(
        client,
        PolicyConfig(max_workers=3),
        capacity=4,
        cold_start_s=30,
        out=lines.append,
        current={**client.get_endpoint(), **wanted},
    )
    assert again.step()[2] == "unchanged" and len(api.updates()) == sent


def test_a_refused_key_is_a_clear_error(api):
    run = _controller(
        "--endpoint", ENDPOINT, "--iterations", "1", *_bases(api), key="rpa_WRONG_key_987"
    )
    assert run.returncode == 1
    assert "RUNPOD_API_KEY was refused" in run.stderr and "HTTP 401" in run.stderr
    assert "Traceback" not in run.stderr
    assert "rpa_WRONG_key_987" not in run.stdout + run.stderr and KEY not in run.stdout + run.stderr
    missing = _controller("--endpoint", ENDPOINT, "--iterations", "1", *_bases(api), key=None)
    assert missing.returncode == 1 and "RUNPOD_API_KEY is not set" in missing.stderr


def test_an_unknown_endpoint_is_a_clear_error(api):
    run = _controller("--endpoint", "nope", "--max-workers", "2", "--iterations", "1", *_bases(api))
    assert run.returncode == 1 and "no endpoint 'nope'" in run.stderr


def test_an_api_that_is_down_or_silent_fails_clearly_without_hanging(caplog):
    with RunPodApiServer(KEY, ENDPOINT) as server:  # a port that was just served, now closed
        bases = _bases(server)
    run = _controller("--endpoint", ENDPOINT, "--interval", "0.05", *bases, timeout=30)
    assert (
        run.returncode == 1
        and "cannot reach the RunPod API" in run.stderr
        and "Traceback" not in run.stderr
    )
    assert KEY not in run.stdout + run.stderr
    # Down after it started: each poll fails with the reason; it gives up after --max-failures in a
    # row.
    client = RunPodApi(KEY, ENDPOINT, queue_api=bases[1], rest_api=bases[3], timeout_s=1)
    lines: list[str] = []
    controller = Controller(
        client, PolicyConfig(max_workers=2), capacity=4, cold_start_s=30, out=lines.append
    )
    with caplog.at_level(logging.DEBUG):
        assert controller.run(interval_s=0.01, iterations=0, max_failures=2) == 1 and lines == []
    assert (
        "cannot reach the RunPod API" in caplog.text
        and "giving up after 2 failed polls" in caplog.text
    )
    assert KEY not in caplog.text
    with socket.socket() as silent:  # accepts connections (the backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        base = f"http://127.0.0.1:{silent.getsockname()[1]}"
        run = _controller(
            "--endpoint",
            ENDPOINT,
            "--max-workers",
            "2",
            "--timeout",
            "0.5",
            "--interval",
            "0.05",
            "--max-failures",
            "2",
            "--api-base",
            base + "/v2",
            "--rest-base",
            base + "/v1",
            timeout=30,
        )
    assert run.returncode == 1 and "timed out" in run.stderr


def test_bad_arguments_name_the_flag():
    run = _controller("--endpoint", ENDPOINT, "--interval", "0")
    assert run.returncode == 2 and "--interval: must be > 0" in run.stderr
    run = _controller("--dry-run")
    assert run.returncode == 2 and "--endpoint: required" in run.stderr


def test_recommend_prints_native_settings_the_update_call_accepts(api):
    config = PolicyConfig(latency_budget_s=3.0, max_workers=3)
    many = recommend(config, capacity=8, cold_start_s=40, mean_service_s=10, arrival_rate=0.0)
    # floor(8 x 0.85) requests/worker
    assert many["scalerType"] == "REQUEST_COUNT" and many["scalerValue"] == 6
    assert many["workersMin"] == 0 and many["workersMax"] == 3 and 1 <= many["idleTimeout"] <= 3600
    one = recommend(config, capacity=1, cold_start_s=40, mean_service_s=10, arrival_rate=0.5)
    assert one["scalerType"] == "QUEUE_DELAY" and one["scalerValue"] == 3
    assert 1 <= one["workersMin"] <= 3  # a steady 0.5 request/s keeps workers warm
    client = RunPodApi(KEY, ENDPOINT, queue_api=api.queue_api, rest_api=api.rest_api)
    # a valid EndpointUpdateInput
    assert client.update_endpoint(**many)["scalerType"] == "REQUEST_COUNT"
    run = _controller("--recommend", "--capacity", "8", "--cold-start", "40", key=None)
    assert (
        run.returncode == 0
        and "scalerType: REQUEST_COUNT" in run.stdout
        and "idleTimeout:" in run.stdout
    )


def test_arrival_meter_counts_new_requests_and_idle_gaps():
    meter = ArrivalMeter(window_s=10)
    h = lambda **kw: EndpointHealth.from_json(health_body(**kw))  # noqa: E731
    assert meter.update(0, h()) == 0 and meter.rate == 0
    assert meter.update(10, h(in_queue=5, completed=5)) == 10
    assert 0.5 < meter.rate < 1.0  # 1 request/s, smoothed over the 10 s window
    # counts that fall (RunPod's window moved) are no arrivals
    assert meter.update(20, h(completed=3)) == 0
    assert meter.idle_for(25) == 5
    meter.update(30, h(completed=3))
    meter.update(42, h(in_queue=1, completed=3))  # traffic is back after 22 s without any
    assert list(meter.gaps) == [22]
    assert meter.idle_for(50) == 0
    # The queue's head, first in first out: 1 queued at 42; by 50 one more came and none was taken.
    assert meter.oldest_wait_s == 0
    meter.update(50, h(in_queue=2, completed=3))
    assert meter.oldest_wait_s == 8
    # the first was taken: the head came by 50
    meter.update(60, h(in_queue=1, in_progress=1, completed=3))
    assert meter.oldest_wait_s == 10
    meter.update(70, h(completed=5))
    assert meter.oldest_wait_s == 0


def test_the_key_never_reaches_repr_or_errors():
    client = RunPodApi(
        KEY,
        ENDPOINT,
        queue_api="http://127.0.0.1:9/v2",
        rest_api="http://127.0.0.1:9/v1",
        timeout_s=0.5,
    )
    assert KEY not in repr(client)
    with pytest.raises(RunPodApiError) as err:
        client.health()
    assert KEY not in str(err.value)
    with pytest.raises(RunPodApiError, match="RUNPOD_API_KEY is not set"):
        RunPodApi("", ENDPOINT)
