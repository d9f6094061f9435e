"""The worker side of the local endpoint: what a worker's runpod SDK asks for (jobs to lease, jobs
to stop) and what it reports (heartbeats, streamed chunks, results), applied to the job queue and
the worker pool. No HTTP here: scaling.endpoint.routes_worker parses the SDK's requests and calls
these.

A booting worker gets only its readiness probe; once ready it leases public jobs, oldest first, up
to the number its SDK asks for. Everything runs in the endpoint's one event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from scaling.endpoint.jobs import Job, JobQueue
from scaling.endpoint.workers import WorkerPool

POLL_HOLD_S = 1.0  # an empty job-take / job-stop poll is held this long before it is answered


class Leases:
    """`on_taken()` runs when jobs leave the queue (the scaler looks again); `on_result(job, now)`
    when a worker's result ends a job."""

    def __init__(
        self,
        queue: JobQueue,
        pool: WorkerPool,
        on_taken: Callable[[], None],
        on_result: Callable[[Job, float], None],
    ):
        self.queue, self.pool = queue, pool
        self.on_taken, self.on_result = on_taken, on_result

    def seen(self, worker_id: str) -> float:
        """Note that the worker spoke (its lease stays alive); the time noted."""
        now = time.monotonic()
        self.pool.seen(worker_id, now)
        return now

    async def take(self, worker_id: str, n: int) -> list[Job]:
        """Up to n jobs for the worker, after holding an empty poll up to POLL_HOLD_S."""
        queue = self.queue
        worker = self.pool.seen(worker_id, time.monotonic())
        if worker is None or worker.state not in ("booting", "ready"):
            await asyncio.sleep(POLL_HOLD_S)  # a draining or unknown worker gets nothing
            return []
        # A poll opened while booting gets the readiness probe or nothing: once ready, the SDK asks
        # again with the concurrency its admission sets from the loaded engine's free KV blocks.
        was_booting = worker.state == "booting"
        if not was_booting:
            worker.polled_capacity = n + queue.held_by(worker_id)

        def probe_waiting() -> bool:
            probe = queue.probe_of(worker_id)
            return probe is not None and probe.status == "IN_QUEUE"

        def wake() -> bool:
            if was_booting:
                return worker.state != "booting" or probe_waiting()
            return worker.state != "ready" or queue.in_queue() > 0

        await queue.wait_until(wake, POLL_HOLD_S)
        if was_booting:
            booting = worker.state == "booting" and probe_waiting()
            jobs = queue.take(worker_id, n, ready=False) if booting else []
        else:
            jobs = queue.take(worker_id, n, ready=True) if worker.state == "ready" else []
        if jobs:
            worker.idle_since = None
            self.on_taken()
        return jobs

    async def stops(self, worker_id: str) -> list[str]:
        """The jobs the worker must stop (cancelled while it runs them); an empty poll is held."""
        self.seen(worker_id)
        await self.queue.wait_until(lambda: bool(self.queue.stops.get(worker_id)), POLL_HOLD_S)
        return self.queue.take_stops(worker_id)

    def heartbeat(self, worker_id: str, job_ids: frozenset[str]) -> None:
        """The SDK's ping, which lists the jobs the worker holds."""
        worker = self.pool.seen(worker_id, time.monotonic())
        if worker is not None:
            worker.pings += 1
            worker.ping_jobs = job_ids

    async def stream(self, worker_id: str, job_id: str, body: Any) -> None:
        """A streamed chunk ({"output": ...}) of a job the worker leases; stale posts do nothing."""
        if isinstance(body, dict) and self.queue.record_stream(worker_id, job_id, body):
            await self.queue.notify()

    async def result(self, worker_id: str, job_id: str, body: Any, now: float) -> None:
        """A job's result ({"output": ...} or {"error": ...}); stale or repeated posts do
        nothing."""
        job = self.queue.record_done(
            worker_id, job_id, body if isinstance(body, dict) else {"output": body}
        )
        if job is not None:
            self.on_result(job, now)
            await self.queue.notify()
