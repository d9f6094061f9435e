"""What the local endpoint's routes work with: its job queue (`queue`), worker processes (`pool`),
what workers take and report (`leases`) and how many there should be (`scaler`), and the calls the
routes make (submit, kick, job_finished, health). `server.Endpoint` adds the lifecycle that serves
them; the app and its routes depend on this module only.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
from typing import Any

from scaling.endpoint.config import EndpointConfig
from scaling.endpoint.jobs import Job, JobQueue
from scaling.endpoint.leases import Leases
from scaling.endpoint.scaler import Scaler
from scaling.endpoint.workers import WorkerPool


class EndpointState:
    """One endpoint's queue, workers, scaler and leases (the last three made when it starts
    serving), and where it listens."""

    def __init__(self, config: EndpointConfig):
        self.config = config
        self.token = secrets.token_urlsafe(18)  # workers' job-route credential; never logged
        self.queue = JobQueue()
        self.pool: WorkerPool | None = None
        self.scaler: Scaler | None = None
        self.leases: Leases | None = None
        self._kick: asyncio.Event | None = None
        self._sock: socket.socket | None = None

    # ---- where it listens ------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"http://{host}:{port}"

    @property
    def base(self) -> str:
        return f"{self.url}/v2/{self.config.endpoint_id}"

    # ---- what the routes call --------------------------------------------------------------------
    async def submit(self, job_input: Any, prefix: str = "") -> Job:
        """Queue a public job and wake the scaler and every waiter."""
        job = self.queue.submit(job_input, prefix)
        self.kick()
        await self.queue.notify()
        return job

    def kick(self) -> None:
        """Run the scaler now (a job arrived or was taken)."""
        if self._kick is not None:
            self._kick.set()

    def job_finished(self, job: Job, now: float) -> None:
        self.scaler.job_finished(job, now)

    def health(self) -> dict:
        return self.scaler.health()
