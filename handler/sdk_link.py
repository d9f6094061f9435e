"""The worker's side of the RunPod SDK's process (handler.sdk_front; the messages are in
handler.front_link): jobs come in and are run by the Worker, their chunks go back as it yields them,
the SDK's count of jobs held comes in (admission's occupancy) and admission's concurrency goes back;
the files the SDK's process imported join this start's start pages (cache.start_pages).
"""

from __future__ import annotations

import asyncio
import logging
import threading

from cache import start_pages
from handler.front_link import SdkProcess, connect, encode, receive

log = logging.getLogger(__name__)


class SdkLink:
    """Serves the SDK's process for one Worker; `held()` is the SDK's count of jobs held."""

    def __init__(self, sdk: SdkProcess):
        self.sdk = sdk
        self.held_jobs = 0
        self.tasks: dict[str, asyncio.Task] = {}

    def held(self) -> int:
        return self.held_jobs

    async def serve(self, worker) -> None:
        """Until the SDK's process ends. It ends on its own only after a SIGTERM (the worker drains
        and exits) or when it fails: then the worker exits 1, as it would with the SDK in its own
        interpreter."""
        reader, writer = await connect(self.sdk.sock)
        # The socket's end may outlive the SDK's process (its heartbeat process, forked, holds a
        # copy): the process's exit closes this end instead, which reads as the end of the link.
        loop = asyncio.get_running_loop()

        def watch() -> None:
            self.sdk.proc.wait()
            loop.call_soon_threadsafe(writer.transport.abort)

        threading.Thread(target=watch, name="sdk-process-watch", daemon=True).start()
        while (msg := await receive(reader)) is not None:
            op = msg["op"]
            if op == "job":
                key = msg["key"]
                self.tasks[key] = asyncio.create_task(self._run(worker, key, msg["job"], writer))
            elif op == "cancel" and msg["key"] in self.tasks:
                self.tasks[msg["key"]].cancel()
            elif op == "files":
                start_pages.add_files(msg["paths"])
                log.info(
                    "RunPod SDK: imported %s, its job loop running %s after process start "
                    "(in its own process)",
                    *(
                        f"{msg[k]:.2f}s" if msg.get(k) is not None else "?"
                        for k in ("imported_s", "loop_s")
                    ),
                )
            elif op == "held":
                self.held_jobs = msg["n"]
                if msg.get("current") is not None:
                    value = worker.admission.concurrency_modifier(msg["current"])
                    writer.write(encode({"op": "concurrency", "value": value}))
        self.held_jobs = 0  # nothing is posted any more
        admission = worker.admission
        if not admission.draining and admission.fatal_error is None:
            log.error(
                "the RunPod SDK's process ended (exit status %s); the worker exits",
                self.sdk.proc.wait(),
            )
            admission.fatal(RuntimeError("the RunPod SDK's process ended"))
        await asyncio.Event().wait()  # admission's exit ends the process

    async def _run(self, worker, key: str, job: dict, writer: asyncio.StreamWriter) -> None:
        try:
            async for item in worker.handle(job):
                writer.write(encode({"op": "chunk", "key": key, "item": item}))
            writer.write(encode({"op": "end", "key": key}))
        except asyncio.CancelledError:
            pass  # the SDK cancelled it: the handler closed and its engine request was aborted
        finally:
            self.tasks.pop(key, None)
