"""The HTTP conventions every route of the local endpoint shares: errors (BadRequest), JSON bodies
within RunPod's size limits, a /run body's `input`, ?wait=, the OpenAI error shape, SSE text, and
the dependencies that hand a route the endpoint state it serves (checking the endpoint id and the
workers' token).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse

from scaling.endpoint.jobs import Job
from scaling.endpoint.state import EndpointState

BASE = "/v2/{endpoint_id}"
RUN_BODY_LIMIT = 10 << 20  # RunPod: /run payloads up to 10 MB, /runsync up to 20 MB
RUNSYNC_BODY_LIMIT = 20 << 20
RUNSYNC_WAIT_MS = (1000, 300_000, 90_000)  # ?wait= bounds and default, as RunPod documents
JOB_FIELDS = ("input",)
UNSUPPORTED_FIELDS = ("webhook", "policy", "s3Config")


class BadRequest(Exception):
    """An answer other than 200: its status and the message naming the field."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


async def bad_request_handler(request: Request, exc: BadRequest) -> JSONResponse:
    """RunPod's `{"error": ...}`, or OpenAI's error object under /openai/."""
    if "/openai/" in request.url.path:
        return openai_error(exc.status, exc.message)
    return JSONResponse({"error": exc.message}, exc.status)


async def json_body(request: Request, limit: int, *, allow_empty: bool = False) -> Any:
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


def job_input(body: Any) -> Any:
    """The `input` of a /run or /runsync body, or BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest(400, f"body: must be a JSON object, got {type(body).__name__}")
    for name in body:
        if name in UNSUPPORTED_FIELDS:
            raise BadRequest(400, f"{name}: not supported by the local endpoint; send only 'input'")
        if name not in JOB_FIELDS:
            raise BadRequest(400, f"{name}: unknown field; accepted: input")
    if "input" not in body:
        raise BadRequest(400, 'input: required (the job\'s input, as {"input": {...}})')
    return body["input"]


def wait_ms(request: Request) -> int:
    lo, hi, default = RUNSYNC_WAIT_MS
    raw = request.query_params.get("wait")
    if raw is None:
        return default
    if not raw.isdigit() or not lo <= int(raw) <= hi:
        raise BadRequest(
            400,
            f"wait: must be an integer number of milliseconds in [{lo}, {hi}], got {raw[:50]!r}",
        )
    return int(raw)


def openai_error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    error = {"message": message, "type": kind, "param": None, "code": status}
    return JSONResponse({"error": error}, status)


def sse_text(chunk: Any) -> str:
    """A streamed openai_route chunk as SSE text: RAW_OPENAI_OUTPUT sends strings, otherwise lists
    of objects."""
    if isinstance(chunk, str):
        return chunk
    items = chunk if isinstance(chunk, list) else [chunk]
    return "".join(
        f"data: {item if isinstance(item, str) else json.dumps(item, ensure_ascii=False)}\n\n"
        for item in items
    )


async def submit(endpoint: EndpointState, job_input: Any, prefix: str = "") -> Job:
    """Queue a public job; a 503 once the endpoint is shutting down."""
    if endpoint.scaler.stopping:
        raise BadRequest(503, "the endpoint is shutting down")
    return await endpoint.submit(job_input, prefix)


def public_job(endpoint: EndpointState, job_id: str) -> Job:
    """A job a client may see (not a worker's readiness probe), or a 404."""
    job = endpoint.queue.jobs.get(job_id)
    if job is None or job.probe_for is not None:
        raise BadRequest(
            404,
            f"job {job_id[:100]!r} not found (finished jobs are kept "
            f"{endpoint.config.result_keep_s:.0f} s)",
        )
    return job


# ---- dependencies: the endpoint's state behind request.app, once the path's endpoint id is checked
def served(request: Request, endpoint_id: str) -> EndpointState:
    endpoint: EndpointState = request.app.state.endpoint
    if endpoint_id != endpoint.config.endpoint_id:
        raise BadRequest(
            404,
            f"endpoint {endpoint_id[:100]!r} not found; this one is "
            f"{endpoint.config.endpoint_id!r}",
        )
    return endpoint


def worker_served(
    request: Request, endpoint: Annotated[EndpointState, Depends(served)]
) -> EndpointState:
    """The job routes: the worker must send the token its RUNPOD_WEBHOOK_* URLs carry."""
    if request.query_params.get("token") != endpoint.token:
        raise BadRequest(
            401, "token: missing or wrong; workers get theirs from RUNPOD_WEBHOOK_GET_JOB"
        )
    return endpoint


def ping_served(
    request: Request, endpoint: Annotated[EndpointState, Depends(served)]
) -> EndpointState:
    """The heartbeat: the SDK sends the key as its Authorization header (or the URL's token)."""
    token = endpoint.token
    if request.headers.get("authorization") != token and request.query_params.get("token") != token:
        raise BadRequest(401, "authorization: missing or wrong")
    return endpoint


Served = Annotated[EndpointState, Depends(served)]
WorkerServed = Annotated[EndpointState, Depends(worker_served)]
PingServed = Annotated[EndpointState, Depends(ping_served)]
