"""`python -m scaling.endpoint`: a local emulator of a RunPod serverless endpoint that scales real worker processes
(`python -m handler` through the runpod SDK) between zero and --max-workers by scaling.policy.decide().

Routes: endpoint_routes; job queue: endpoint_jobs; processes: endpoint_workers; scaling: endpoint_scaler.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from scaling.endpoint_config import EndpointConfig
from scaling.endpoint_jobs import Job, JobQueue
from scaling.endpoint_routes import BadRequest, build_app
from scaling.endpoint_scaler import Scaler
from scaling.endpoint_workers import WorkerPool

__all__ = ["Endpoint", "EndpointConfig", "main"]

log = logging.getLogger("scaling.endpoint")


class Endpoint:
    """The emulator: `with Endpoint(EndpointConfig(port=0, ...)) as ep:` serves on ep.url (ep.base is /v2/<id>)."""

    def __init__(self, config: EndpointConfig):
        self.config = config
        self.token = secrets.token_urlsafe(18)  # workers' job-route credential; never logged
        self.queue = JobQueue()
        self.pool: WorkerPool | None = None
        self.scaler: Scaler | None = None
        self._kick: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server = None
        self._sock: socket.socket | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    # ---- where it listens ------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"http://{host}:{port}"

    @property
    def base(self) -> str:
        return f"{self.url}/v2/{self.config.endpoint_id}"

    # ---- what the routes call --------------------------------------------------------------------------------------
    async def submit(self, job_input: Any, prefix: str = "") -> Job:
        if self.scaler.stopping:
            raise BadRequest(503, "the endpoint is shutting down")
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

    async def _scale(self) -> None:
        while True:
            try:
                self.scaler.step(time.monotonic())
                await self.queue.notify()
            except Exception:  # a bad pass must not end scaling; the next one retries
                log.exception("scaler pass failed")
            self._kick.clear()
            try:
                await asyncio.wait_for(self._kick.wait(), self.config.tick_s)
            except asyncio.TimeoutError:
                pass

    # ---- lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> "Endpoint":
        """Bind, start the server and the scaler in a background thread; returns once it serves."""
        import uvicorn

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
        config = uvicorn.Config(build_app(self), log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5)
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

        self._thread = threading.Thread(target=asyncio.run, args=(serve(),), name="coldbrew-endpoint", daemon=True)
        self._thread.start()
        started.wait()
        while not self._server.started and self._thread.is_alive():
            time.sleep(0.02)
        log.info("local endpoint on %s (workers: 0..%d, idle keep-alive up to %.0f s, worker logs in %s)",
                 self.base, c.max_workers, c.idle_s, log_dir)
        return self

    async def _drain_all(self, timeout_s: float) -> None:
        now = time.monotonic()
        self.scaler.drain_all(now)
        deadline = now + timeout_s
        while self.pool.workers and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # the scaler keeps reaping; results posted meanwhile still land
        for worker in list(self.pool.workers.values()):
            self.pool.kill(worker)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Drain every worker (in-flight jobs finish) within timeout_s, kill what is left, stop serving."""
        if self._thread is None:
            return
        if self._loop is not None and self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._drain_all(timeout_s), self._loop).result(timeout_s + 10)
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


def _parse(argv: list[str]) -> EndpointConfig:
    worker_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, worker_args = argv[:cut], argv[cut + 1:]
    d = EndpointConfig()
    ap = argparse.ArgumentParser(prog="python -m scaling.endpoint", description=__doc__.split("\n\n")[0],
                                 epilog="Arguments after -- go to each worker (python -m handler ...). Workers read "
                                        "their settings (MODEL_NAME, MAX_CONCURRENCY, ...) from this environment.")
    ap.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host})")
    ap.add_argument("--port", type=int, default=d.port, help=f"port; 0 picks a free one (default {d.port})")
    ap.add_argument("--endpoint-id", default=d.endpoint_id, help=f"the id in /v2/<id>/... (default {d.endpoint_id})")
    ap.add_argument("--min-workers", type=int, default=d.min_workers,
                    help=f"workers kept even when idle (default {d.min_workers})")
    ap.add_argument("--max-workers", type=int, default=d.max_workers,
                    help=f"most workers at once (default {d.max_workers})")
    ap.add_argument("--idle-s", type=float, default=d.idle_s,
                    help=f"longest an idle worker is kept warm before it is drained (default {d.idle_s:.0f})")
    ap.add_argument("--latency-budget-s", type=float, default=d.latency_budget_s,
                    help="queue wait accepted before another worker starts (default 2)")
    ap.add_argument("--cold-start-s", type=float, default=d.cold_start_s,
                    help="worker start time assumed until one is measured (default 30)")
    ap.add_argument("--capacity", type=float, default=None,
                    help="jobs one worker holds, assumed until one reports (default: MAX_CONCURRENCY, else 8)")
    ap.add_argument("--rate-window-s", type=float, default=d.rate_window_s,
                    help="window of the arrival rate (default 30)")
    ap.add_argument("--lease-timeout-s", type=float, default=d.lease_timeout_s,
                    help="a worker silent this long is killed and its jobs retried (default 60)")
    ap.add_argument("--log-dir", default=None, help="where worker logs go (default: a temporary directory)")
    args = ap.parse_args(argv)
    try:
        return EndpointConfig(**vars(args), worker_args=worker_args)
    except ValueError as exc:
        flag = str(exc).split(":")[0].replace("_", "-")
        ap.error(f"--{flag}:{str(exc).split(':', 1)[1]}")


def main(argv: list[str] | None = None) -> None:
    config = _parse(sys.argv[1:] if argv is None else list(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        endpoint = Endpoint(config).start()
    except OSError as exc:
        sys.exit(f"coldbrew: can't listen on {config.host}:{config.port} (--host/--port): {exc.strerror or exc}")
    print(f"coldbrew local endpoint: {endpoint.base}  (OpenAI: {endpoint.base}/openai/v1)\n"
          f"  curl -s -X POST {endpoint.base}/runsync -H 'Content-Type: application/json' "
          "-d '{\"input\": {\"prompt\": \"The capital of France is\", \"sampling_params\": {\"max_tokens\": 16}}}'",
          flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(1.0):
        pass
    log.info("stopping: draining workers")
    endpoint.stop()


if __name__ == "__main__":
    main()
