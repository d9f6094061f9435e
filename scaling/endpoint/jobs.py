"""The local endpoint's job queue: jobs from IN_QUEUE to a final status, leased to one worker at a
time, their streamed chunks and results, one retry when a worker is lost mid-job, and the waits the
HTTP routes block on.

Everything here runs in the endpoint's one event loop (no locks); `changed` wakes every waiter after
any update.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT")
# a job lost with its worker runs once more on another worker, then fails with an error
MAX_ATTEMPTS = 2


@dataclass
class Job:
    """One request. Times are time.monotonic() seconds."""

    id: str
    input: Any
    created: float
    # set on a worker's readiness probe: only that worker takes it, it is never listed
    probe_for: str | None = None
    status: str = "IN_QUEUE"
    # the worker holding the lease while IN_PROGRESS (the last one after)
    worker_id: str | None = None
    attempts: int = 0
    started: float | None = None
    finished: float | None = None
    output: Any = None
    error: str | None = None
    stream: list = field(default_factory=list)  # every chunk the worker streamed, in order
    stream_read: int = 0  # chunks already handed to a /stream poller
    # some chunk reached a client: a retry could show it twice, so the job is not retried
    delivered: bool = False
    done_posts: int = 0  # job-done posts received for this job, stale or duplicate ones included

    @property
    def final(self) -> bool:
        return self.status in FINAL

    def view(self) -> dict:
        """The job as RunPod's /status answers: id, status, delayTime and executionTime (ms), output
        or error."""
        out: dict[str, Any] = {"id": self.id, "status": self.status}
        if self.started is not None:
            out["delayTime"] = round((self.started - self.created) * 1000)
            if self.finished is not None:
                out["executionTime"] = round((self.finished - self.started) * 1000)
        if self.worker_id is not None:
            out["workerId"] = self.worker_id
        if self.status == "COMPLETED":
            out["output"] = self.output
        elif self.error is not None:
            out["error"] = self.error
        return out


class JobQueue:
    """The jobs, the FIFO of those waiting, the leases, the stop signals for workers and the
    endpoint's counters."""

    def __init__(self) -> None:
        self.jobs: dict[str, Job] = {}
        self.waiting: deque[str] = deque()
        # worker id -> job ids it must stop (cancelled while running)
        self.stops: dict[str, list[str]] = {}
        self.counts = {"completed": 0, "failed": 0, "retried": 0}
        # creation times of recent public jobs (the arrival rate)
        self.arrivals: deque[float] = deque()
        self.service_s: float | None = None  # moving average of take -> result of completed jobs
        self.changed = asyncio.Condition()

    # ---- waiting --------------------------------------------------------------------------------
    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_until(self, predicate, timeout: float) -> bool:
        """Block until predicate() holds (re-checked after each change) or timeout seconds pass; its
        last value."""
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(predicate), timeout)
            except asyncio.TimeoutError:
                pass
            return bool(predicate())

    # ---- the public side ------------------------------------------------------------------------
    def submit(self, job_input: Any, prefix: str = "") -> Job:
        now = time.monotonic()
        job = Job(id=f"{prefix}{uuid.uuid4()}", input=job_input, created=now)
        self.jobs[job.id] = job
        self.waiting.append(job.id)
        self.arrivals.append(now)
        return job

    def add_probe(self, worker_id: str, probe_input: Any) -> Job:
        job = Job(
            id=f"probe-{worker_id}-{uuid.uuid4().hex[:8]}",
            input=probe_input,
            created=time.monotonic(),
            probe_for=worker_id,
        )
        self.jobs[job.id] = job
        return job

    def cancel(self, job: Job) -> None:
        """A queued job leaves the queue; a running one is signalled to its worker, whose later
        posts are ignored."""
        if job.final:
            return
        if job.status == "IN_QUEUE":
            self._unqueue(job.id)
        elif job.worker_id is not None:
            self.stops.setdefault(job.worker_id, []).append(job.id)
        self._finish(job, "CANCELLED", error="cancelled by request")

    def purge(self) -> int:
        """Cancel every queued public job; jobs in progress go on."""
        ids = [i for i in self.waiting]
        for job_id in ids:
            self.cancel(self.jobs[job_id])
        return len(ids)

    def time_out(self, job: Job, reason: str) -> None:
        if job.status == "IN_PROGRESS" and job.worker_id is not None:
            self.stops.setdefault(job.worker_id, []).append(job.id)
        self._finish(job, "TIMED_OUT", error=reason)

    # ---- the worker side ------------------------------------------------------------------------
    def take(self, worker_id: str, n: int, *, ready: bool) -> list[Job]:
        """Up to n jobs for this worker: its readiness probe while it boots, public jobs (oldest
        first) once ready."""
        now = time.monotonic()
        taken: list[Job] = []
        if not ready:
            probe = self.probe_of(worker_id)
            if probe is not None and probe.status == "IN_QUEUE":
                taken.append(probe)
        else:
            while self.waiting and len(taken) < n:
                taken.append(self.jobs[self.waiting.popleft()])
        for job in taken:
            job.status, job.worker_id, job.started = "IN_PROGRESS", worker_id, now
            job.attempts += 1
        return taken

    def probe_of(self, worker_id: str) -> Job | None:
        return next(
            (j for j in self.jobs.values() if j.probe_for == worker_id and not j.final), None
        )

    def take_stops(self, worker_id: str) -> list[str]:
        return self.stops.pop(worker_id, [])

    def holds(self, worker_id: str, job_id: str) -> Job | None:
        """The job if this worker holds its lease now; None for stale posts (the job moved on or
        ended)."""
        job = self.jobs.get(job_id)
        if job is None or job.status != "IN_PROGRESS" or job.worker_id != worker_id:
            return None
        return job

    def record_stream(self, worker_id: str, job_id: str, body: dict) -> bool:
        job = self.holds(worker_id, job_id)
        if job is None or "output" not in body:
            return False
        job.stream.append(body["output"])
        return True

    def record_done(self, worker_id: str, job_id: str, body: dict) -> Job | None:
        """A worker's result: the job ends COMPLETED (output) or FAILED (its error); stale or
        repeated posts count in done_posts but change nothing."""
        job = self.jobs.get(job_id)
        if job is not None:
            job.done_posts += 1
        job = self.holds(worker_id, job_id)
        if job is None:
            return None
        if "error" in body:
            self._finish(job, "FAILED", error=str(body["error"]))
        else:
            self._finish(job, "COMPLETED", output=body.get("output"))
            if job.probe_for is None and job.started is not None:
                took = job.finished - job.started
                average = self.service_s
                self.service_s = took if average is None else 0.8 * average + 0.2 * took
        return job

    def lose_worker(self, worker_id: str, reason: str) -> list[tuple[Job, str]]:
        """The worker is gone: each job it held runs again (first loss, nothing shown to a client
        yet) or fails explicitly. Returns (job, "retried" | "failed") pairs."""
        outcomes = []
        for job in self.leased_by(worker_id):
            if job.probe_for is not None:
                self._finish(
                    job, "FAILED", error=f"worker {worker_id} {reason} before it was ready"
                )
                outcomes.append((job, "failed"))
            elif job.attempts < MAX_ATTEMPTS and not job.delivered:
                job.status, job.stream, job.stream_read = "IN_QUEUE", [], 0
                self.waiting.appendleft(job.id)
                self.counts["retried"] += 1
                outcomes.append((job, "retried"))
            else:
                why = (
                    "part of its output was already streamed to the client"
                    if job.delivered
                    else f"this was attempt {job.attempts} of {MAX_ATTEMPTS}"
                )
                self._finish(
                    job,
                    "FAILED",
                    error=f"worker {worker_id} {reason} while running the job; not retried: {why}",
                )
                outcomes.append((job, "failed"))
        self.stops.pop(worker_id, None)
        return outcomes

    def fail_waiting(self, error: str) -> int:
        """Fail every queued public job with `error` (workers can't start); the count failed."""
        ids = list(self.waiting)
        for job_id in ids:
            self._unqueue(job_id)
            self._finish(self.jobs[job_id], "FAILED", error=error)
        return len(ids)

    # ---- what the scaler and /health read -------------------------------------------------------
    def in_queue(self) -> int:
        return len(self.waiting)

    def in_progress(self) -> int:
        return sum(
            1 for j in self.jobs.values() if j.status == "IN_PROGRESS" and j.probe_for is None
        )

    def leased_by(self, worker_id: str) -> list[Job]:
        """The jobs the worker holds now (IN_PROGRESS under its lease)."""
        return [
            j for j in self.jobs.values() if j.status == "IN_PROGRESS" and j.worker_id == worker_id
        ]

    def held_by(self, worker_id: str) -> int:
        return len(self.leased_by(worker_id))

    def oldest_wait_s(self, now: float) -> float:
        return now - self.jobs[self.waiting[0]].created if self.waiting else 0.0

    def arrival_rate(self, now: float, window_s: float) -> float:
        while self.arrivals and self.arrivals[0] < now - window_s:
            self.arrivals.popleft()
        return len(self.arrivals) / window_s

    def forget_finished(self, now: float, keep_s: float) -> None:
        """Drop final jobs older than keep_s (RunPod keeps /run results for 30 minutes)."""
        for job_id in [
            j.id
            for j in self.jobs.values()
            if j.final and j.finished is not None and now - j.finished > keep_s
        ]:
            del self.jobs[job_id]

    # ---- internals ------------------------------------------------------------------------------
    def _unqueue(self, job_id: str) -> None:
        try:
            self.waiting.remove(job_id)
        except ValueError:
            pass

    def _finish(
        self, job: Job, status: str, *, output: Any = None, error: str | None = None
    ) -> None:
        job.status, job.finished, job.output, job.error = status, time.monotonic(), output, error
        if job.probe_for is None:
            if status == "COMPLETED":
                self.counts["completed"] += 1
            elif status in ("FAILED", "TIMED_OUT"):
                self.counts["failed"] += 1
