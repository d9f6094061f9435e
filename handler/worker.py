"""The RunPod serverless worker: an async-generator job handler, run for `runpod.serverless.start`
in the SDK's own process (handler.sdk_front relays the jobs here; handler.sdk_link serves it), the
engine loading in the background from process start. Every job ends in one result: its output, or
`{"error": ...}`.

A job's final output carries a `metrics` block (handler.job_timing.job_metrics): its queue wait,
measured from the moment the SDK hands the job to the handler (the SDK passes the job-take answer on
as it came, `id`, `input` and `webhook` as documented, and stamps no time on it, so nothing dates
the enqueue; RunPod's own queue time is the `delayTime` of /status), the worker's capacity and its
cold-start phases.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from handler.admission import Admission, Ticket
from handler.config import Settings, SettingsError, load_settings
from handler.engine_boot import EngineBoot, begin
from handler.front_link import SdkProcess, wants_sdk_process
from handler.job_timing import JobTiming, TimedEngine, job_metrics
from handler.jobs import (
    Job,
    JobAborted,
    JobInputError,
    parse_job,
    run_engine_job,
    run_openai_job,
    stream_error_batch,
)
from handler.protocol import ApiError
from handler.sdk_link import SdkLink

log = logging.getLogger(__name__)


def _is_out_of_memory(exc: BaseException) -> bool:
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower()


async def _abortable(stream: AsyncIterator, ticket: Ticket) -> AsyncIterator:
    """Items of `stream` until it ends or the ticket's abort is set; an abort (or the job being
    cancelled) cancels the pending read, which closes the engine request and frees its blocks. An
    abort raises JobAborted(reason)."""
    stop = asyncio.ensure_future(ticket.abort.wait())
    read = None
    try:
        while True:
            read = asyncio.ensure_future(anext(stream))
            await asyncio.wait({read, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not read.done():
                raise JobAborted(ticket.reason or "request aborted")
            try:
                item = read.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        stop.cancel()
        if read is not None:
            if not read.done():
                read.cancel()
            # also retrieves a read that ended (StopAsyncIteration, an error) just as this job was
            # cancelled
            await asyncio.gather(read, return_exceptions=True)
        await stream.aclose()


def _is_final_output(item: Any) -> bool:
    """The chunk that ends a served job: worker-vllm's last batch (each choice has its
    finish_reason) or a whole (not streamed) OpenAI completion. Streamed OpenAI chunks stay exactly
    as the OpenAI API sends them."""
    if not isinstance(item, dict) or "error" in item:
        return False
    choices = item.get("choices")
    if item.get("object") in ("chat.completion", "text_completion"):
        return True
    return (
        isinstance(choices, list)
        and bool(choices)
        and "object" not in item
        and all(isinstance(c, dict) and "finish_reason" in c for c in choices)
    )


class Worker:
    """The job handler and its collaborators: settings, the engine boot, admission, and the OpenAI
    routes."""

    def __init__(self, settings: Settings, boot: EngineBoot, admission: Admission):
        self.settings = settings
        self.boot = boot
        self.admission = admission
        self._routes = None

    def routes(self, engine):
        if self._routes is None:
            from handler.routes import OpenAIRoutes

            self._routes = OpenAIRoutes(TimedEngine(engine), self.settings, self.boot.served_names)
        return self._routes

    async def handle(self, job: dict) -> AsyncIterator[Any]:
        """The SDK's handler: yields output chunks; a failure is one final `{"error": message}`
        chunk."""
        job_id = str(job.get("id", ""))
        try:
            parsed = parse_job(job.get("input"))
        except JobInputError as exc:
            log.info("job %s refused: %s", job_id, exc)
            yield {"error": exc.error}
            return
        if self.admission.fatal_error is not None:
            message = "the engine failed; this worker is restarting, retry the request"
            yield {"error": parsed.answer(503, message)}
            return
        timing = JobTiming()
        if self.boot.is_ready:
            # no wait for the engine: it was up when the job came
            timing.engine_ready = timing.received
        with self.admission.track(job_id) as ticket:
            async for item in self._run(job_id, parsed, ticket, timing):
                if _is_final_output(item):
                    item["metrics"] = job_metrics(
                        timing, self.admission.capacity(), self.boot.phases
                    )
                yield item

    async def _run(
        self, job_id: str, job: Job, ticket: Ticket, timing: JobTiming
    ) -> AsyncIterator[Any]:
        try:
            engine = await self._await_engine(ticket)
            if timing.engine_ready is None:
                timing.engine_ready = time.time()
        except JobAborted as exc:
            yield {"error": job.answer(503, str(exc))}
            return
        except Exception as exc:  # the model could not be loaded: nothing this worker can serve
            self.admission.fatal(exc)
            yield {"error": job.answer(503, f"the model failed to load: {exc}")}
            return
        try:
            routes, observe = self.routes(engine), self.admission.observe
            if job.openai_output:
                stream = run_openai_job(routes, job, self.settings, on_finish=observe)
            else:
                request_id = f"job-{job_id}-{uuid.uuid4().hex[:8]}"
                stream = run_engine_job(
                    TimedEngine(engine, timing),
                    routes,
                    job,
                    self.settings,
                    request_id,
                    on_finish=observe,
                )
            # the OpenAI routes' engine requests find their job through the running task
            with timing.current():
                async for item in _abortable(stream, ticket):
                    yield item
        except JobAborted as exc:  # cut short: ended as on the HTTP face (error event, [DONE])
            last = stream_error_batch(job, ApiError(503, str(exc)), self.settings)
            if last is not None:
                yield last
            yield {"error": job.answer(503, str(exc))}
        except Exception as exc:
            yield {"error": self._job_error(job_id, job, engine, exc)}

    def _job_error(self, job_id: str, job: Job, engine, exc: Exception) -> str | dict:
        """What a failed job answers; a dead engine also starts the fatal exit. Errors a request
        can cause are logged in one line, errors of the machine with their traceback."""
        # checked first: a dead engine fails every stream, whatever it raised
        if engine.errored is not None:
            self.admission.fatal(engine.errored)
            name = type(engine.errored).__name__
            return job.answer(500, f"the engine failed ({name}); the worker restarts")
        if isinstance(exc, ApiError):
            log.info("job %s refused: %s", job_id, exc.message)
            return job.error(exc)
        if isinstance(exc, (JobInputError, ValueError)):  # ValueError: the engine refused it
            log.info("job %s refused: %s", job_id, exc)
            return job.answer(400, str(exc))
        if _is_out_of_memory(exc):
            log.warning("job %s: out of memory: %s", job_id, exc)
            return job.answer(
                500, "out of memory serving this request; try a shorter prompt or fewer tokens"
            )
        log.exception("job %s failed", job_id)
        return job.answer(500, f"internal error: {type(exc).__name__}: {exc}")

    async def _await_engine(self, ticket: Ticket):
        """The engine once loaded; a job aborted (drain) while waiting gives up."""
        ready = asyncio.ensure_future(self.boot.ready())
        stop = asyncio.ensure_future(ticket.abort.wait())
        try:
            await asyncio.wait({ready, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not ready.done():
            ready.cancel()
            raise JobAborted(ticket.reason or "request aborted")
        return ready.result()


def _log_ready_line(boot: EngineBoot, argv: list[str]) -> None:
    """In the SDK's local API mode, say how to call it once the engine is up."""
    if "--rp_serve_api" not in argv:
        return
    host = argv[argv.index("--rp_api_host") + 1] if "--rp_api_host" in argv else "localhost"
    port = argv[argv.index("--rp_api_port") + 1] if "--rp_api_port" in argv else "8000"

    def announce() -> None:
        try:
            boot.load_blocking()
        except BaseException:  # the load error is reported by the boot and by every job
            return
        print(
            f"coldbrew: model ready. Try:\n  curl -s -X POST http://{host}:{port}/runsync "
            "-H 'Content-Type: application/json' "
            '-d \'{"input": {"prompt": "The capital of France is", '
            '"sampling_params": {"max_tokens": 16, "temperature": 0}}}\'',
            flush=True,
        )

    threading.Thread(target=announce, name="coldbrew-announce", daemon=True).start()


def _run_local_job(worker: Worker, argv: list[str]) -> int:
    """The SDK's local test mode (`--test_input JSON` or ./test_input.json, off RunPod) runs a job
    through a path that can't drive an async-generator handler: run that one job here, print its
    result as RunPod would, exit."""
    if "--test_input" in argv:
        job = json.loads(argv[argv.index("--test_input") + 1])
    elif os.path.exists("test_input.json"):
        with open("test_input.json", encoding="utf-8") as f:
            job = json.load(f)
    else:
        print(
            "coldbrew: not on RunPod (no job queue configured). "
            "Use --rp_serve_api for the SDK's local API, "
            "--test_input '{\"input\": {...}}' for one job, or `python -m handler serve`.",
            file=sys.stderr,
        )
        return 1

    async def collect() -> dict:
        chunks = [
            c
            async for c in worker.handle(
                {"id": job.get("id", "local_test"), "input": job.get("input")}
            )
        ]
        errors = [c["error"] for c in chunks if isinstance(c, dict) and "error" in c]
        return {"error": errors[-1]} if errors else {"output": chunks}

    result = asyncio.run(collect())
    print(json.dumps(result, ensure_ascii=False), flush=True)
    return 1 if "error" in result else 0


def main(
    argv: list[str] | None = None,
    boot: EngineBoot | None = None,
    sdk: SdkProcess | None = None,
) -> None:
    """`python -m handler [--rp_serve_api --rp_api_host H --rp_api_port N ...]`: the RunPod worker.

    boot: the engine's start, already begun by the entry point (handler.__main__.begin) before this
    module's imports; None: begin it here. sdk: the SDK's process (handler.sdk_front), started by
    the entry point at process start; None: started here. The SDK's local test (one job from
    --test_input or ./test_input.json) runs in this process, without the SDK."""
    argv = sys.argv[1:] if argv is None else argv
    if sdk is None and wants_sdk_process(argv):
        sdk = SdkProcess(argv)
    if boot is None:
        try:
            boot = begin(load_settings())
        except SettingsError as exc:
            if sdk is not None:
                sdk.close()
            sys.exit(f"coldbrew: {exc}")
    settings = boot.settings
    _log_ready_line(boot, argv)
    if sdk is None:
        # one job, run here: no SDK holds any
        admission = Admission(settings.max_concurrency, boot, occupancy=lambda: 0)
        worker = Worker(settings, boot, admission)
        admission.drain_on_sigterm()
        code = _run_local_job(worker, argv)
        # The engine's start may still run on its thread (a job refused before it was needed): end
        # the process without finalising the interpreter under it (torch aborts when its native
        # threads meet interpreter teardown mid-import).
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    sdk.configure(settings.log_level, settings.max_concurrency)
    link = SdkLink(sdk)
    admission = Admission(
        settings.max_concurrency, boot, grace_s=settings.shutdown_grace_s, occupancy=link.held
    )
    admission.drain_on_sigterm(then=sdk.terminate)
    try:
        asyncio.run(link.serve(Worker(settings, boot, admission)))
    except Exception:  # the link to the SDK broke: nothing can reach this worker any more
        log.exception("the link to the RunPod SDK's process failed; the worker exits")
        logging.shutdown()
        os._exit(1)
