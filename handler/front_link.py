"""The link between the RunPod worker and the SDK's own process (handler.sdk_front): how the worker
starts that process, and the messages they exchange. Standard library only: both processes import
this first thing. The server and its engine's process (handler.engine_link,
handler.engine_process) are started and speak the same way (spawn, encode, receive, read_first).

The worker starts the SDK's process at process start, before its settings, so that the SDK's import
runs beside the engine's start. One Unix socket joins them; each message is one JSON object on one
line:

  worker -> SDK   {"op": "config", "log_level": L, "concurrency": N}  once, first
                  {"op": "chunk", "key": K, "item": ...}  an output chunk of job K
                  {"op": "end", "key": K}                 job K yielded its last chunk
                  {"op": "concurrency", "value": N}        the answer to a "held"
  SDK -> worker   {"op": "files", "paths": [...]}          its start files, once its loop runs
                  {"op": "job", "key": K, "job": {...}}   a job as the SDK handed it over
                  {"op": "cancel", "key": K}               the SDK cancelled job K (job-stop, ...)
                  {"op": "held", "n": N, "current": C}     jobs the SDK holds; its concurrency now

The worker's end closing means the SDK's process ends; the SDK's process ending (its loop stopped
after a SIGTERM, or a crash) closes the other end.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the longest message (a line): a job's input or one chunk of its output, whole
LINE_LIMIT = 1 << 30


def encode(msg: dict) -> bytes:
    # ASCII escapes carry what UTF-8 cannot (a lone surrogate a job may hold) through unchanged
    return (json.dumps(msg) + "\n").encode()


async def connect(sock: socket.socket) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """The socket in the running event loop."""
    import asyncio  # here: this module is imported before the weights move, asyncio is not needed

    return await asyncio.open_unix_connection(sock=sock, limit=LINE_LIMIT)


async def receive(reader: asyncio.StreamReader) -> dict | None:
    """The next message, or None once the other end closed."""
    line = await reader.readline()
    return json.loads(line) if line else None


def read_first(sock: socket.socket) -> dict | None:
    """The first message, read without buffering past it (what follows is read by asyncio); None
    if the other end closed first."""
    data = bytearray()
    while not data.endswith(b"\n"):
        byte = sock.recv(1)
        if not byte:
            return None
        data += byte
    return json.loads(data)


def spawn(module: str, *argv: str) -> tuple[socket.socket, subprocess.Popen]:
    """`python -m module FD *argv` with this process's environment (this repo first on its path),
    FD its end of a new socket pair: (this end, the process)."""
    ours, theirs = socket.socketpair()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", module, str(theirs.fileno()), *argv],
        pass_fds=(theirs.fileno(),),
        stdin=subprocess.DEVNULL,
        env=env,
    )
    theirs.close()
    return ours, proc


class SdkProcess:
    """The SDK's process, started by the worker with its own flags; `sock` is the worker's end."""

    def __init__(self, argv: list[str]):
        self.sock, self.proc = spawn("handler.sdk_front", *argv)
        self.configured = False

    def configure(self, log_level: str, concurrency: int) -> None:
        """The settings the SDK's process waits for before it starts the SDK (sent once)."""
        if not self.configured:
            self.configured = True
            msg = {"op": "config", "log_level": log_level, "concurrency": concurrency}
            self.sock.sendall(encode(msg))

    def terminate(self) -> None:
        """Pass a SIGTERM on: the SDK stops taking jobs and ends once those it holds are done."""
        if self.proc.poll() is None:
            self.proc.terminate()

    def close(self) -> None:
        """The worker is going (its settings were refused, ...): the SDK's process ends with it."""
        try:
            self.sock.close()
        finally:
            self.terminate()


def wants_sdk_process(argv: list[str]) -> bool:
    """True unless the SDK would run its local test (one job from --test_input or
    ./test_input.json), which the worker runs itself: the SDK's own rule
    (runpod/serverless/modules/worker_state.py, IS_LOCAL_TEST) is that RUNPOD_WEBHOOK_GET_JOB is
    unset, and its local API (--rp_serve_api) and realtime port (RUNPOD_REALTIME_PORT) come first
    (runpod/serverless/__init__.py, start)."""
    return (
        "RUNPOD_WEBHOOK_GET_JOB" in os.environ
        or "--rp_serve_api" in argv
        or bool(os.environ.get("RUNPOD_REALTIME_PORT"))
    )
