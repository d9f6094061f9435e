"""Test helper: a worker behind the runpod SDK's own local API (`--rp_serve_api`) in a fresh
process, and /runsync.

`with local_api(argv, cwd, env) as base:` starts `argv --rp_serve_api ...` on a free port, waits
until it listens, yields its base URL and stops it (SIGINT, then its whole process group).
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator

from child_process import stop

WAIT_S = 240


def free_port() -> int:
    # The SDK's --rp_api_port has no "any port" form, so ask the kernel for a free one just before
    # starting.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_api(argv: list[str], cwd, env: dict[str, str]) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        argv + ["--rp_serve_api", "--rp_api_host", "127.0.0.1", "--rp_api_port", str(port)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    threading.Thread(
        target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True
    ).start()
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc, signal.SIGINT, 20)


def runsync(base: str, job_input: dict, timeout_s: float = WAIT_S) -> tuple[int, dict]:
    """POST /runsync {"input": job_input}: the HTTP status and the answer."""
    req = urllib.request.Request(
        f"{base}/runsync",
        data=json.dumps({"input": job_input}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return resp.status, json.loads(resp.read())
