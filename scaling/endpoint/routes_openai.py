"""RunPod's OpenAI-compatible route on the local endpoint (/openai/v1/...): each call becomes an
`openai_route` job; the answer is the job's output, or its chunks relayed as server-sent events.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from scaling.endpoint.jobs import Job
from scaling.endpoint.protocol import (
    BASE,
    RUNSYNC_BODY_LIMIT,
    BadRequest,
    Served,
    json_body,
    openai_error,
    sse_text,
    submit,
)
from scaling.endpoint.state import EndpointState

OPENAI_WAIT_S = 3600.0  # an /openai/v1 call waits this long for its job
OPENAI_ROUTES = {"chat/completions": "/v1/chat/completions", "completions": "/v1/completions"}

router = APIRouter()


@router.get(BASE + "/openai/v1/models")
async def models(endpoint: Served, request: Request):
    return await openai_job(endpoint, request, {"openai_route": "/v1/models"}, stream=False)


@router.post(BASE + "/openai/v1/{route:path}")
async def openai(endpoint: Served, route: str, request: Request):
    if route.strip("/") not in OPENAI_ROUTES:
        raise BadRequest(
            404,
            f"route: /openai/v1/{route[:100]} is not served; use one of "
            + ", ".join(f"/openai/v1/{r}" for r in OPENAI_ROUTES),
        )
    body = await json_body(request, RUNSYNC_BODY_LIMIT)
    if not isinstance(body, dict):
        raise BadRequest(400, f"body: must be a JSON object, got {type(body).__name__}")
    job_input = {"openai_route": OPENAI_ROUTES[route.strip("/")], "openai_input": body}
    return await openai_job(endpoint, request, job_input, stream=body.get("stream") is True)


async def openai_job(endpoint: EndpointState, request: Request, job_input: dict, *, stream: bool):
    """Run one openai_route job: its output, its stream as SSE, or an OpenAI-shaped error."""
    queue = endpoint.queue
    job = await submit(endpoint, job_input, prefix="oai-")
    # Wait for the result (or, streaming, the first chunk): a request refused before any output is
    # a plain error.
    while not (job.final or (stream and job.stream)):
        await queue.wait_until(lambda: job.final or (stream and bool(job.stream)), 1.0)
        if not job.final and await request.is_disconnected():
            queue.cancel(job)
            await queue.notify()
            return Response(status_code=499)
        if not job.final and time.monotonic() - job.created > OPENAI_WAIT_S:
            queue.time_out(job, f"no result within {OPENAI_WAIT_S:.0f} s")
    if stream and (job.stream or job.status == "COMPLETED"):
        return StreamingResponse(
            relay_sse(endpoint, request, job),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    if job.status == "COMPLETED":
        output = job.output
        return output[0] if isinstance(output, list) and output else output
    if job.status == "FAILED":
        return openai_error(400, job.error or "the job failed")
    return openai_error(503, f"{job.status}: {job.error}", "server_error")


async def relay_sse(endpoint: EndpointState, request: Request, job: Job) -> AsyncIterator[str]:
    """The job's chunks as they arrive; an error event if it ends other than COMPLETED; a client
    that goes away cancels the job."""
    queue = endpoint.queue
    sent, finished = 0, False
    try:
        while True:
            await queue.wait_until(lambda: job.final or len(job.stream) > sent, 1.0)
            chunks = job.stream[sent:]
            sent += len(chunks)
            for chunk in chunks:
                job.delivered = True
                yield sse_text(chunk)
            if job.final:
                finished = True
                if job.status != "COMPLETED":
                    error = {
                        "message": f"{job.status}: {job.error}",
                        "type": "server_error",
                        "param": None,
                        "code": 500,
                    }
                    yield f"data: {json.dumps({'error': error})}\n\n"
                return
            if await request.is_disconnected():
                return
    finally:
        if not finished and not job.final:  # the client went away: stop the worker's request
            queue.cancel(job)
            asyncio.ensure_future(queue.notify())
