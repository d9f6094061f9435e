"""The local endpoint's worker processes: each one is the real RunPod worker (`python -m handler`,
the runpod SDK's loop) pointed at the endpoint's job routes through the SDK's own RUNPOD_*
variables; started, drained, reaped.

A worker is booting until its readiness probe (a /v1/models job, which waits for the engine) comes
back, then ready.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # where `python -m handler` is found
PING_INTERVAL_MS = 2000  # the SDK's heartbeat period (RUNPOD_PING_INTERVAL)


@dataclass
class Worker:
    """One worker process. Times are time.monotonic() seconds."""

    id: str
    proc: subprocess.Popen
    started: float
    log_path: Path
    state: str = "booting"  # booting -> ready -> draining -> exited
    ready_at: float | None = None
    last_seen: float | None = None  # its last request (job-take, ping, stream, done), if any
    idle_since: float | None = None  # ready and holding no job since then
    drain_started: float | None = None
    # jobs its SDK holds at once: the batch size it asks for + the jobs it holds
    polled_capacity: int | None = None
    reported_capacity: int | None = None  # capacity_requests in its last job output's metrics
    pings: int = 0  # heartbeats received
    ping_jobs: frozenset[str] = frozenset()  # the jobs its last heartbeat said it holds

    @property
    def capacity(self) -> int | None:
        return self.reported_capacity or self.polled_capacity

    @property
    def cold_start_s(self) -> float | None:
        return None if self.ready_at is None else self.ready_at - self.started


class WorkerPool:
    """Starts workers with the RUNPOD_* variables that point the SDK at `job_base`
    (.../v2/<endpoint id>)."""

    def __init__(
        self,
        job_base: str,
        token: str,
        log_dir: Path,
        worker_env: dict[str, str] | None = None,
        worker_command: list[str] | None = None,
    ):
        self.job_base = job_base
        self.token = token
        self.log_dir = Path(log_dir)
        self.worker_env = dict(worker_env or {})
        self.worker_command = list(worker_command or [sys.executable, "-m", "handler"])
        self.workers: dict[str, Worker] = {}
        self.started_total = 0
        self.pids: dict[str, int] = {}  # every worker ever started -> its pid

    def sdk_env(self, worker_id: str) -> dict[str, str]:
        """The variables the runpod SDK reads to find its job server (it substitutes $ID and
        $RUNPOD_POD_ID)."""
        q = f"?token={self.token}"
        return {
            "RUNPOD_POD_ID": worker_id,
            # the heartbeat starts only when a key is set; sent as its auth header
            "RUNPOD_AI_API_KEY": self.token,
            "RUNPOD_WEBHOOK_GET_JOB": f"{self.job_base}/job-take/$ID{q}",
            "RUNPOD_WEBHOOK_POST_OUTPUT": f"{self.job_base}/job-done/$RUNPOD_POD_ID/$ID{q}",
            "RUNPOD_WEBHOOK_POST_STREAM": f"{self.job_base}/job-stream/$RUNPOD_POD_ID/$ID{q}",
            "RUNPOD_WEBHOOK_PING": f"{self.job_base}/ping/$RUNPOD_POD_ID{q}",
            "RUNPOD_PING_INTERVAL": str(PING_INTERVAL_MS),
            # The SDK's start-up checks probe the network and a GPU; a local endpoint needs neither.
            "RUNPOD_SKIP_AUTO_SYSTEM_CHECKS": "true",
            "RUNPOD_SKIP_GPU_CHECK": "true",
        }

    def start(self, now: float) -> Worker:
        self.started_total += 1
        worker_id = f"worker-{self.started_total}"
        env = {**os.environ, **self.worker_env, **self.sdk_env(worker_id)}
        paths = (str(REPO_ROOT), env.get("PYTHONPATH", ""))
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{worker_id}.log"
        with open(log_path, "wb") as out:
            # Its own session: the SDK's heartbeat is a child process that outlives a killed
            # worker; the group goes.
            proc = subprocess.Popen(
                self.worker_command,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        worker = Worker(worker_id, proc, started=now, log_path=log_path)
        self.workers[worker_id] = worker
        self.pids[worker_id] = proc.pid
        return worker

    def seen(self, worker_id: str, now: float) -> Worker | None:
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.last_seen = now
        return worker

    def drain(self, worker: Worker, now: float) -> None:
        """SIGTERM: the worker finishes what it holds, takes nothing new and exits 0."""
        worker.state, worker.drain_started = "draining", now
        with contextlib.suppress(ProcessLookupError):
            worker.proc.send_signal(signal.SIGTERM)

    def kill(self, worker: Worker) -> None:
        """SIGKILL the worker's whole process group (it and the SDK's heartbeat child)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            worker.proc.kill()

    def reap(self, worker: Worker) -> int | None:
        """The worker's exit status once its main process has ended (its leftover children are
        killed); else None."""
        code = worker.proc.poll()
        if code is None:
            return None
        worker.state = "exited"
        self.kill(worker)
        self.workers.pop(worker.id, None)
        return code

    def live(self, *states: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.state in states]

    def log_tail(self, worker: Worker, chars: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return worker.log_path.read_text(errors="replace")[-chars:]
        return ""

    def stop_all(self, timeout_s: float = 30.0) -> None:
        """SIGTERM every worker, wait up to timeout_s for them to exit, then SIGKILL what is left
        (groups too)."""
        now = time.monotonic()
        for worker in list(self.workers.values()):
            if worker.state != "draining":
                self.drain(worker, now)
        deadline = now + timeout_s
        for worker in list(self.workers.values()):
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(max(0.1, deadline - time.monotonic()))
            self.kill(worker)
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(5)
            self.workers.pop(worker.id, None)
