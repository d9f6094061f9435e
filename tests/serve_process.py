"""Test helper: run `python -m handler serve --port 0` in a subprocess on loopback, wait until
/health is 200.

The server prints the port it bound; `stop()` sends SIGTERM (graceful) and returns the exit code.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from child_process import stop

REPO = Path(__file__).resolve().parent.parent
_PORT_LINE = re.compile(r"OpenAI server on http://127\.0\.0\.1:(\d+)/v1")


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick), for a child told its port in advance."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    def __init__(self, env: dict[str, str], ready_timeout: float = 300.0):
        full_env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("MODEL_", "OPENAI_", "DEFAULT_"))
        }
        full_env.update(env)
        full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "handler", "serve", "--host", "127.0.0.1", "--port", "0"],
            cwd=REPO,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        port_found = threading.Event()
        self.port: int | None = None

        # keep reading so the pipe never fills; remember the output for failure messages
        def pump() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                m = _PORT_LINE.search(line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    port_found.set()
            port_found.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + ready_timeout
        port_found.wait(ready_timeout)
        if self.port is None:
            self.stop()
            raise RuntimeError("serve did not start:\n" + self.output())
        self.base_url = f"http://127.0.0.1:{self.port}"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}:\n" + self.output())
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("serve never became healthy:\n" + self.output())

    def output(self) -> str:
        return "".join(self.lines[-200:])

    def stop(self, timeout: float = 60.0) -> int:
        return stop(self.proc, signal.SIGTERM, timeout)
