"""The RunPod SDK's own process. `python -m handler` starts it first thing, so the SDK's import
(aiohttp, paramiko, its CPU probe: over a second) runs beside the worker's start instead of in the
worker interpreter's own turn; an import in a second interpreter costs torch's import nothing
measurable (bench/start_overlap.py).

`python -m handler.sdk_front FD [SDK flags]`, FD its end of the worker's socket (handler.front_link,
which also lists the messages). It waits for the worker's settings, then runs
`runpod.serverless.start` with a relay for a handler: each job goes to the worker, which runs it
(handler.worker.Worker.handle) and sends its chunks back, and the SDK's concurrency_modifier answers
with the worker's latest word. The jobs, the engine and the exits stay with the worker; the worker's
end closing ends this process.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import sys
from collections.abc import AsyncIterator

from handler import front_link

HELD_EVERY_S = 0.1  # how often the jobs the SDK holds are reported while the count changes


class Relay:
    """The SDK's handler and concurrency_modifier, relayed to the worker over the socket."""

    def __init__(self, sock: socket.socket, concurrency: int, imported_s: float | None = None):
        self.sock = sock
        self.imported_s = imported_s  # process start -> the SDK imported
        self.concurrency = concurrency
        self.writer: asyncio.StreamWriter | None = None
        self.jobs: dict[str, asyncio.Queue] = {}
        self.keys = (str(k) for k in itertools.count())
        self._connecting: asyncio.Task | None = None

    async def connect(self) -> None:
        """Join the socket to the SDK's event loop (once; the SDK makes the loop)."""
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
        await asyncio.shield(self._connecting)

    async def _open(self) -> None:
        from cache.start_pages import start_files, stop_watching
        from warmup.start import process_age_s

        reader, self.writer = await front_link.connect(self.sock)
        # once the SDK's loop runs (what its start-up imported included), the files it imported:
        # the worker records them with its own start pages, so a cold start reads them first
        msg = {"op": "files", "paths": start_files(), "imported_s": self.imported_s}
        self._send({**msg, "loop_s": process_age_s()})
        stop_watching()
        loop = asyncio.get_running_loop()
        loop.create_task(self._read(reader))
        loop.create_task(self._report_held())

    def _send(self, msg: dict) -> None:
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(front_link.encode(msg))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while (msg := await front_link.receive(reader)) is not None:
            op = msg["op"]
            if op == "concurrency":
                self.concurrency = msg["value"]
            elif op in ("chunk", "end") and msg["key"] in self.jobs:
                self.jobs[msg["key"]].put_nowait(msg)
        os._exit(0)  # the worker is gone: so is what it served (its exit status is the worker's)

    async def _report_held(self) -> None:
        """The SDK's count of jobs held, sent when it changes: the worker's drain and exit wait for
        it to reach 0 (the SDK drops a job once its result is posted)."""
        from runpod.serverless.modules.worker_state import JobsProgress

        last = None
        while True:
            n = JobsProgress().get_job_count()
            if n != last:
                self._send({"op": "held", "n": n, "current": None})
                last = n
            await asyncio.sleep(HELD_EVERY_S)

    async def handle(self, job: dict) -> AsyncIterator:
        """The SDK's async-generator handler: the worker's chunks of this job, as it yields them."""
        await self.connect()
        key = next(self.keys)
        chunks = self.jobs[key] = asyncio.Queue()
        self._send({"op": "job", "key": key, "job": job})
        ended = False
        try:
            while True:
                msg = await chunks.get()
                if msg["op"] == "end":
                    ended = True
                    return
                yield msg["item"]
        finally:
            del self.jobs[key]
            if not ended:  # cancelled by the SDK (job-stop, shutdown): the worker aborts it
                self._send({"op": "cancel", "key": key})

    def concurrency_modifier(self, current: int) -> int:
        """The SDK's call before each job-take, in its event loop: the worker's latest answer (the
        question goes out now; its answer serves the next call)."""
        if self.writer is None:
            asyncio.ensure_future(self.connect())
        else:
            from runpod.serverless.modules.worker_state import JobsProgress

            self._send({"op": "held", "n": JobsProgress().get_job_count(), "current": current})
        return self.concurrency


def main(argv: list[str]) -> None:
    from cache import start_pages
    from warmup.start import hold_gc, process_age_s, release_gc

    hold_gc()  # off for the SDK's import, as for the worker's start
    start_pages.watch_opens()  # the data files the SDK reads (metadata, certificates) count too
    sock = socket.socket(fileno=int(argv[0]))
    import runpod
    from runpod.serverless.modules.rp_logger import RunPodLogger

    imported_s = process_age_s()

    config = front_link.read_first(sock)
    if config is None:  # the worker ended before its settings (refused, or killed)
        sys.exit(0)

    level = config["log_level"]
    # The SDK logs every job's output at DEBUG, its default; it follows LOG_LEVEL unless
    # --rp_log_level is given.
    RunPodLogger().set_level({"WARNING": "WARN", "CRITICAL": "ERROR"}.get(level, level))
    relay = Relay(sock, config["concurrency"], imported_s)
    sys.argv = [sys.argv[0], *argv[1:]]  # the SDK parses its own flags from sys.argv
    release_gc()
    runpod.serverless.start(
        {
            "handler": relay.handle,
            "return_aggregate_stream": True,
            "concurrency_modifier": relay.concurrency_modifier,
        }
    )


if __name__ == "__main__":
    main(sys.argv[1:])
