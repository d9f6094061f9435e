"""Test helper: a worker behind the runpod SDK's own local API (`--rp_serve_api`) in a fresh
process, and /runsync.

`with local_api(argv, cwd, env) as base:` starts `argv --rp_serve_api ...` on a free port, waits
until it listens (and, with `until`, until its output so far satisfies it), yields its base URL and
stops it (SIGINT, then its whole process group). `output`, when given, receives the process's
output lines as they come.
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
from collections.abc import Callable, Iterator

from child_process import stop
from serve_process import free_port

WAIT_S = 240


@contextlib.contextmanager
def local_api(
    argv: list[str],
    cwd,
    env: dict[str, str],
    until: Callable[[list[str]], bool] | None = None,
    output: list[str] | None = None,
) -> Iterator[str]:
    port = free_port()  # the SDK's --rp_api_port has no "any port" form
    proc = subprocess.Popen(
        argv + ["--rp_serve_api", "--rp_api_host", "127.0.0.1", "--rp_api_port", str(port)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = [] if output is None else output
    threading.Thread(
        target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True
    ).start()
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            with socket.socket() as s:
                listening = s.connect_ex(("127.0.0.1", port)) == 0
            if listening and (until is None or until(lines)):
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
