"""The local endpoint's HTTP surface (FastAPI): RunPod's public endpoint API (/run, /runsync, /status, /stream,
/cancel, /purge-queue, /health, /openai/v1/...) and the job routes its workers' runpod SDK polls and posts to.

Shapes follow RunPod's documented responses; the state behind them is `endpoint.queue` and `endpoint.pool`.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from scaling.endpoint_jobs import Job

RUN_BODY_LIMIT = 10 << 20  # RunPod: /run payloads up to 10 MB, /runsync up to 20 MB
RUNSYNC_BODY_LIMIT = 20 << 20
RUNSYNC_WAIT_MS = (1000, 300_000, 90_000)  # ?wait= bounds and default, as RunPod documents
POLL_HOLD_S = 1.0  # an empty job-take / job-stop poll is held this long before its 204
STREAM_HOLD_S = 1.0  # /stream waits this long for a new chunk before answering with none
OPENAI_WAIT_S = 3600.0  # an /openai/v1 call waits this long for its job
OPENAI_ROUTES = {"chat/completions": "/v1/chat/completions", "completions": "/v1/completions"}
JOB_FIELDS = ("input",)
UNSUPPORTED_FIELDS = ("webhook", "policy", "s3Config")


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


async def _json_body(request: Request, limit: int, *, allow_empty: bool = False) -> Any:
    body = await request.body()
    if len(body) > limit:
        raise BadRequest(413, f"body: {len(body)} bytes exceeds the limit of {limit} bytes")
    if not body:
        if allow_empty:
            return None
        raise BadRequest(400, "body: empty; send a JSON object")
    try:
        return json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(400, f"body: invalid JSON ({exc})") from None


def _job_input(body: Any) -> Any:
    """The `input` of a /run or /runsync body, or BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest(400, f"body: must be a JSON object, got {type(body).__name__}")
    for name in body:
        if name in UNSUPPORTED_FIELDS:
            raise BadRequest(400, f"{name}: not supported by the local endpoint; send only 'input'")
        if name not in JOB_FIELDS:
            raise BadRequest(400, f"{name}: unknown field; accepted: input")
    if "input" not in body:
        raise BadRequest(400, "input: required (the job's input, as {\"input\": {...}})")
    return body["input"]


def _wait_ms(request: Request) -> int:
    lo, hi, default = RUNSYNC_WAIT_MS
    raw = request.query_params.get("wait")
    if raw is None:
        return default
    if not raw.isdigit() or not lo <= int(raw) <= hi:
        raise BadRequest(400, f"wait: must be an integer number of milliseconds in [{lo}, {hi}], got {raw[:50]!r}")
    return int(raw)


def _openai_error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


def _sse_text(chunk: Any) -> str:
    """A streamed openai_route chunk as SSE text: RAW_OPENAI_OUTPUT sends strings, otherwise lists of objects."""
    if isinstance(chunk, str):
        return chunk
    items = chunk if isinstance(chunk, list) else [chunk]
    return "".join(f"data: {item if isinstance(item, str) else json.dumps(item, ensure_ascii=False)}\n\n"
                   for item in items)


def build_app(endpoint) -> FastAPI:
    """The app for one Endpoint (see scaling.endpoint)."""
    app = FastAPI(title="coldbrew local endpoint", docs_url=None, redoc_url=None)
    queue, pool = endpoint.queue, endpoint.pool
    base = "/v2/{endpoint_id}"

    @app.exception_handler(BadRequest)
    async def _bad_request(request: Request, exc: BadRequest):
        if "/openai/" in request.url.path:
            return _openai_error(exc.status, exc.message)
        return JSONResponse({"error": exc.message}, exc.status)

    def check_endpoint(endpoint_id: str) -> None:
        if endpoint_id != endpoint.config.endpoint_id:
            raise BadRequest(404, f"endpoint {endpoint_id[:100]!r} not found; this one is "
                                  f"{endpoint.config.endpoint_id!r}")

    def public_job(endpoint_id: str, job_id: str) -> Job:
        check_endpoint(endpoint_id)
        job = queue.jobs.get(job_id)
        if job is None or job.probe_for is not None:
            raise BadRequest(404, f"job {job_id[:100]!r} not found (finished jobs are kept "
                                  f"{endpoint.config.result_keep_s:.0f} s)")
        return job

    # ---- RunPod's queue API -------------------------------------------------------------------------------------
    @app.post(base + "/run")
    async def run(endpoint_id: str, request: Request):
        check_endpoint(endpoint_id)
        job = await endpoint.submit(_job_input(await _json_body(request, RUN_BODY_LIMIT)))
        return {"id": job.id, "status": job.status}

    @app.post(base + "/runsync")
    async def runsync(endpoint_id: str, request: Request):
        check_endpoint(endpoint_id)
        wait_s = _wait_ms(request) / 1000
        job = await endpoint.submit(_job_input(await _json_body(request, RUNSYNC_BODY_LIMIT)), prefix="sync-")
        await queue.wait_until(lambda: job.final, wait_s)
        return job.view() if job.final else {"id": job.id, "status": job.status}

    @app.api_route(base + "/status/{job_id}", methods=["GET", "POST"])
    async def status(endpoint_id: str, job_id: str):
        return public_job(endpoint_id, job_id).view()

    @app.api_route(base + "/stream/{job_id}", methods=["GET", "POST"])
    async def stream(endpoint_id: str, job_id: str):
        job = public_job(endpoint_id, job_id)
        await queue.wait_until(lambda: job.final or len(job.stream) > job.stream_read, STREAM_HOLD_S)
        chunks = job.stream[job.stream_read:]
        job.stream_read += len(chunks)
        job.delivered = job.delivered or bool(chunks)
        out = {"id": job.id, "status": job.status, "stream": [{"output": c} for c in chunks]}
        if job.error is not None and job.final:
            out["error"] = job.error
        return out

    @app.post(base + "/cancel/{job_id}")
    async def cancel(endpoint_id: str, job_id: str):
        job = public_job(endpoint_id, job_id)
        queue.cancel(job)
        await queue.notify()
        return {"id": job.id, "status": job.status}

    @app.post(base + "/purge-queue")
    async def purge(endpoint_id: str):
        check_endpoint(endpoint_id)
        removed = queue.purge()
        await queue.notify()
        return {"removed": removed, "status": "completed"}

    @app.get(base + "/health")
    async def health(endpoint_id: str):
        check_endpoint(endpoint_id)
        return endpoint.health()

    # ---- RunPod's OpenAI-compatible route: openai_route jobs --------------------------------------------------------
    @app.get(base + "/openai/v1/models")
    async def models(endpoint_id: str, request: Request):
        check_endpoint(endpoint_id)
        return await openai_job(request, {"openai_route": "/v1/models"}, stream=False)

    @app.post(base + "/openai/v1/{route:path}")
    async def openai(endpoint_id: str, route: str, request: Request):
        check_endpoint(endpoint_id)
        if route.strip("/") not in OPENAI_ROUTES:
            raise BadRequest(404, f"route: /openai/v1/{route[:100]} is not served; use one of "
                                  + ", ".join(f"/openai/v1/{r}" for r in OPENAI_ROUTES))
        body = await _json_body(request, RUNSYNC_BODY_LIMIT)
        if not isinstance(body, dict):
            raise BadRequest(400, f"body: must be a JSON object, got {type(body).__name__}")
        job_input = {"openai_route": OPENAI_ROUTES[route.strip("/")], "openai_input": body}
        return await openai_job(request, job_input, stream=body.get("stream") is True)

    async def openai_job(request: Request, job_input: dict, *, stream: bool):
        job = await endpoint.submit(job_input, prefix="oai-")
        # Wait for the result (or, streaming, the first chunk): a request refused before any output is a plain error.
        while not (job.final or (stream and job.stream)):
            await queue.wait_until(lambda: job.final or (stream and bool(job.stream)), 1.0)
            if not job.final and await request.is_disconnected():
                queue.cancel(job)
                await queue.notify()
                return Response(status_code=499)
            if not job.final and time.monotonic() - job.created > OPENAI_WAIT_S:
                queue.time_out(job, f"no result within {OPENAI_WAIT_S:.0f} s")
        if stream and (job.stream or job.status == "COMPLETED"):
            return StreamingResponse(relay_sse(request, job), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        if job.status == "COMPLETED":
            output = job.output
            return output[0] if isinstance(output, list) and output else output
        if job.status == "FAILED":
            return _openai_error(400, job.error or "the job failed")
        return _openai_error(503, f"{job.status}: {job.error}", "server_error")

    async def relay_sse(request: Request, job: Job) -> AsyncIterator[str]:
        sent, finished = 0, False
        try:
            while True:
                await queue.wait_until(lambda: job.final or len(job.stream) > sent, 1.0)
                chunks = job.stream[sent:]
                sent += len(chunks)
                for chunk in chunks:
                    job.delivered = True
                    yield _sse_text(chunk)
                if job.final:
                    finished = True
                    if job.status != "COMPLETED":
                        error = {"message": f"{job.status}: {job.error}", "type": "server_error", "param": None,
                                 "code": 500}
                        yield f"data: {json.dumps({'error': error})}\n\n"
                    return
                if await request.is_disconnected():
                    return
        finally:
            if not finished and not job.final:  # the client went away: stop the worker's request
                queue.cancel(job)
                asyncio.ensure_future(queue.notify())

    # ---- the routes the workers' runpod SDK calls -------------------------------------------------------------------
    def check_worker(endpoint_id: str, request: Request) -> None:
        check_endpoint(endpoint_id)
        if request.query_params.get("token") != endpoint.token:
            raise BadRequest(401, "token: missing or wrong; workers get theirs from RUNPOD_WEBHOOK_GET_JOB")

    async def take(worker_id: str, n: int) -> list[Job]:
        now = time.monotonic()
        worker = pool.seen(worker_id, now)
        if worker is None or worker.state not in ("booting", "ready"):
            await asyncio.sleep(POLL_HOLD_S)  # a draining or unknown worker gets nothing
            return []
        # A poll opened while booting gets the readiness probe or nothing: once ready, the SDK asks again with the
        # concurrency its admission sets from the loaded engine's free KV blocks.
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
            jobs = queue.take(worker_id, n, ready=False) if worker.state == "booting" and probe_waiting() else []
        else:
            jobs = queue.take(worker_id, n, ready=True) if worker.state == "ready" else []
        if jobs:
            worker.idle_since = None
            endpoint.kick()
        return jobs

    @app.get(base + "/job-take/{worker_id}")
    async def job_take(endpoint_id: str, worker_id: str, request: Request):
        check_worker(endpoint_id, request)
        jobs = await take(worker_id, 1)
        return {"id": jobs[0].id, "input": jobs[0].input} if jobs else Response(status_code=204)

    @app.get(base + "/job-take-batch/{worker_id}")
    async def job_take_batch(endpoint_id: str, worker_id: str, request: Request):
        check_worker(endpoint_id, request)
        raw = request.query_params.get("batch_size", "1")
        if not raw.isdigit() or not 1 <= int(raw) <= 100_000:
            raise BadRequest(400, f"batch_size: must be an integer in [1, 100000], got {raw[:50]!r}")
        jobs = await take(worker_id, int(raw))
        return [{"id": j.id, "input": j.input} for j in jobs] if jobs else Response(status_code=204)

    @app.get(base + "/job-stop/{worker_id}")
    async def job_stop(endpoint_id: str, worker_id: str, request: Request):
        check_worker(endpoint_id, request)
        pool.seen(worker_id, time.monotonic())
        await queue.wait_until(lambda: bool(queue.stops.get(worker_id)), POLL_HOLD_S)
        stops = queue.take_stops(worker_id)
        return {"jobsToStop": stops} if stops else Response(status_code=204)

    @app.get(base + "/ping/{worker_id}")
    async def ping(endpoint_id: str, worker_id: str, request: Request):
        check_endpoint(endpoint_id)
        if request.headers.get("authorization") != endpoint.token and \
                request.query_params.get("token") != endpoint.token:
            raise BadRequest(401, "authorization: missing or wrong")
        worker = pool.seen(worker_id, time.monotonic())
        if worker is not None:  # the SDK's heartbeat lists the jobs the worker holds: job_id=a,b
            worker.pings += 1
            worker.ping_jobs = frozenset(j for j in request.query_params.get("job_id", "").split(",") if j)
        return {}

    @app.post(base + "/job-stream/{worker_id}/{job_id}")
    async def job_stream(endpoint_id: str, worker_id: str, job_id: str, request: Request):
        check_worker(endpoint_id, request)
        pool.seen(worker_id, time.monotonic())
        body = await _json_body(request, RUNSYNC_BODY_LIMIT)
        if isinstance(body, dict) and queue.record_stream(worker_id, job_id, body):
            await queue.notify()
        return {}

    @app.post(base + "/job-done/{worker_id}/{job_id}")
    async def job_done(endpoint_id: str, worker_id: str, job_id: str, request: Request):
        check_worker(endpoint_id, request)
        now = time.monotonic()
        pool.seen(worker_id, now)
        body = await _json_body(request, RUNSYNC_BODY_LIMIT)
        job = queue.record_done(worker_id, job_id, body if isinstance(body, dict) else {"output": body})
        if job is not None:
            endpoint.job_finished(job, now)
            await queue.notify()
        return {}

    return app
