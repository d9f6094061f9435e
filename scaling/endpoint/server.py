"""The local endpoint's lifecycle: binds its socket, serves its app (scaling.endpoint.app) and runs
its scaler in a background thread with one event loop, and drains every worker when it stops. What
the routes read and change is scaling.endpoint.state's.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from scaling.endpoint.config import EndpointConfig
from scaling.endpoint.leases import Leases
from scaling.endpoint.scaler import Scaler
from scaling.endpoint.state import EndpointState
from scaling.endpoint.workers import WorkerPool

log = logging.getLogger("scaling.endpoint")


class Endpoint(EndpointState):
    """The emulator: `with Endpoint(EndpointConfig(port=0, ...)) as ep:` serves on ep.url (ep.base
    is /v2/<id>)."""

    def __init__(self, config: EndpointConfig):
        super().__init__(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    async def _scale(self) -> None:
        while True:
            try:
                self.scaler.step(time.monotonic())
                await self.queue.notify()
            except Exception:  # a bad pass must not end scaling; the next one retries it
                log.exception("scaler pass failed")
            self._kick.clear()
            try:
                await asyncio.wait_for(self._kick.wait(), self.config.tick_s)
            except asyncio.TimeoutError:
                pass

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "Endpoint":
        """Bind, start the server and the scaler in a background thread; returns once it serves."""
        import uvicorn  # the HTTP stack loads only when an endpoint serves

        from scaling.endpoint.app import build_app

        c = self.config
        family = socket.AF_INET6 if ":" in c.host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((c.host, c.port))
        self._sock.listen(1024)
        log_dir = c.log_dir
        if log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="coldbrew-endpoint-")
            log_dir = self._tmp.name
        worker_cmd = (c.worker_command or [sys.executable, "-m", "handler"]) + list(c.worker_args)
        self.pool = WorkerPool(self.base, self.token, Path(log_dir), c.worker_env, worker_cmd)
        self.scaler = Scaler(c, self.queue, self.pool)
        self.leases = Leases(self.queue, self.pool, on_taken=self.kick, on_result=self.job_finished)
        config = uvicorn.Config(
            build_app(self),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        self._server = uvicorn.Server(config)
        started = threading.Event()

        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            self._kick = asyncio.Event()
            scaler = asyncio.ensure_future(self._scale())
            started.set()
            try:
                await self._server.serve(sockets=[self._sock])
            finally:
                scaler.cancel()

        self._thread = threading.Thread(
            target=asyncio.run, args=(serve(),), name="coldbrew-endpoint", daemon=True
        )
        self._thread.start()
        started.wait()
        while not self._server.started and self._thread.is_alive():
            time.sleep(0.02)
        log.info(
            "local endpoint on %s (workers: 0..%d, idle keep-alive up to %.0f s, "
            "worker logs in %s)",
            self.base,
            c.max_workers,
            c.idle_s,
            log_dir,
        )
        return self

    async def _drain_all(self, timeout_s: float) -> None:
        now = time.monotonic()
        self.scaler.drain_all(now)
        deadline = now + timeout_s
        while self.pool.workers and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # the scaler keeps reaping; results posted meanwhile land
        for worker in list(self.pool.workers.values()):
            self.pool.kill(worker)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Drain every worker (in-flight jobs finish) within timeout_s, kill what is left, stop
        serving."""
        if self._thread is None:
            return
        if self._loop is not None and self._thread.is_alive():
            drained = asyncio.run_coroutine_threadsafe(self._drain_all(timeout_s), self._loop)
            drained.result(timeout_s + 10)
        self._server.should_exit = True
        self._thread.join(30)
        self.pool.stop_all(5)
        self._sock.close()
        self._thread = None
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> "Endpoint":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
