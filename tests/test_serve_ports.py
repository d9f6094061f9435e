"""`python -m handler serve` on a RunPod load-balancing endpoint: PORT makes it listen on
0.0.0.0:$PORT; PORT_HEALTH adds a port answering /ping as the load balancer reads it (200
healthy, 204 initializing, other: unhealthy; runpod/docs serverless/load-balancing/overview.mdx);
explicit --host/--port win. Real processes and a real HTTP client (httpx); the health port's
answers also against a stand-in for the server's own /ping.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from child_process import stop
from handler.health_port import HealthPort
from serve_process import free_port

REPO = Path(__file__).resolve().parent.parent
WAIT_S = 300


class _Serve:
    """`python -m handler serve ARGS` with `env` added; its output kept as it arrives."""

    def __init__(self, env: dict[str, str], *args: str):
        inherited = {
            k: v for k, v in os.environ.items() if not k.startswith(("MODEL_", "PORT", "RUNPOD_"))
        }
        full_env = {**inherited, **env, "PYTHONPATH": str(REPO), "DEVICE": "cpu"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "handler", "serve", *args],
            cwd=REPO,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for_line(self, pattern: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not re.search(pattern, self.output()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                time.sleep(0.5)  # the last lines of an exited process
                assert re.search(pattern, self.output()), self.output()[-3000:]
                return
            time.sleep(0.05)


def _ping_until_ready(url: str, proc: subprocess.Popen) -> list[int | None]:
    """Poll `url` as the load balancer does until it answers 200: the statuses seen
    (None: connection refused)."""
    seen: list[int | None] = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            seen.append(httpx.get(url, timeout=10).status_code)
        except httpx.TransportError:
            seen.append(None)
        if seen[-1] == 200:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"never 200: {seen[-20:]}")


@pytest.mark.slow
def test_port_and_port_health_as_runpod_load_balancing_sets_them(smollm2_dir):
    port, health = free_port(), free_port()
    serve = _Serve(
        {
            "PORT": str(port),
            "PORT_HEALTH": str(health),
            "MODEL_NAME": smollm2_dir,
            "MAX_MODEL_LEN": "2048",
        }
    )
    try:
        seen = _ping_until_ready(f"http://127.0.0.1:{health}/ping", serve.proc)
        answered = [s for s in seen if s is not None]
        # Initializing (204) while the model loads, then healthy (200): never unhealthy between.
        assert set(answered) <= {204, 200} and 204 in answered, seen
        assert f"OpenAI server on http://0.0.0.0:{port}/v1" in serve.output()  # every interface
        assert httpx.get(f"http://127.0.0.1:{port}/ping", timeout=10).status_code == 200
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert smollm2_dir in [m["id"] for m in models["data"]]
        other = httpx.get(f"http://127.0.0.1:{health}/v1/models", timeout=10)
        assert other.status_code == 404 and "/ping" in other.json()["error"]["message"]
    finally:
        code = stop(serve.proc, signal.SIGTERM, 60)
    # uvicorn re-raises the SIGTERM it handled once it has shut down
    assert code in (0, -signal.SIGTERM), serve.output()[-3000:]


def test_explicit_host_and_port_win_over_port():
    port, explicit = free_port(), free_port()
    serve = _Serve(
        {"PORT": str(port), "MODEL_NAME": "/nonexistent/model"},
        "--host",
        "127.0.0.1",
        "--port",
        str(explicit),
    )
    try:
        serve.wait_for_line(rf"OpenAI server on http://127\.0\.0\.1:{explicit}/v1")
        assert serve.proc.wait(WAIT_S) == 1  # the model can't load: the server stops, non-zero
    finally:
        stop(serve.proc)
    assert "/nonexistent/model" in serve.output()


def test_a_health_port_needs_a_known_server_port():
    env = {**os.environ, "PORT_HEALTH": str(free_port()), "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "handler", "serve", "--port", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        env=env,
    )
    assert done.returncode != 0 and "PORT_HEALTH" in done.stderr and "--port" in done.stderr


class _StandInServer(ThreadingHTTPServer):
    """Stands in for the server's own /ping (handler/server.py: 204 loading, 200 ready, 503
    failed), answering `status`."""

    daemon_threads = True

    def __init__(self, port: int):
        self.status = 204
        super().__init__(("127.0.0.1", port), _PingHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _PingHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        body = b"" if self.server.status == 204 else b'{"status": "ok"}'
        self.send_response(self.server.status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_the_health_port_answers_what_the_server_answers():
    server_port = free_port()
    health = HealthPort("127.0.0.1", 0, "0.0.0.0", server_port).start()
    url = f"http://127.0.0.1:{health.server_address[1]}"
    try:
        assert httpx.get(url + "/ping").status_code == 204  # nothing listens yet: starting
        stand_in = _StandInServer(server_port)
        assert httpx.get(url + "/ping").status_code == 204
        stand_in.status = 200
        ready = httpx.get(url + "/ping")
        assert ready.status_code == 200 and ready.json() == {"status": "ok"}
        stand_in.status = 503
        assert httpx.get(url + "/ping").status_code == 503
        stand_in.shutdown()
        stand_in.server_close()
        gone = httpx.get(url + "/ping")  # it answered before and now refuses: it stopped
        assert gone.status_code == 503 and "ConnectionRefusedError" in gone.json()["error"]
        assert httpx.get(url + "/health").status_code == 404
    finally:
        health.shutdown()
        health.server_close()
