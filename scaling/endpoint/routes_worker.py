"""The job routes the workers' runpod SDK polls and posts to (the RUNPOD_WEBHOOK_* URLs that
scaling.endpoint.workers hands each worker): take jobs, stop jobs, heartbeat, stream, result.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from scaling.endpoint.protocol import (
    BASE,
    RUNSYNC_BODY_LIMIT,
    BadRequest,
    PingServed,
    WorkerServed,
    json_body,
)

MAX_BATCH = 100_000

router = APIRouter()


@router.get(BASE + "/job-take/{worker_id}")
async def job_take(endpoint: WorkerServed, worker_id: str):
    jobs = await endpoint.leases.take(worker_id, 1)
    return {"id": jobs[0].id, "input": jobs[0].input} if jobs else Response(status_code=204)


@router.get(BASE + "/job-take-batch/{worker_id}")
async def job_take_batch(endpoint: WorkerServed, worker_id: str, request: Request):
    raw = request.query_params.get("batch_size", "1")
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_BATCH:
        raise BadRequest(
            400, f"batch_size: must be an integer in [1, {MAX_BATCH}], got {raw[:50]!r}"
        )
    jobs = await endpoint.leases.take(worker_id, int(raw))
    return [{"id": j.id, "input": j.input} for j in jobs] if jobs else Response(status_code=204)


@router.get(BASE + "/job-stop/{worker_id}")
async def job_stop(endpoint: WorkerServed, worker_id: str):
    stops = await endpoint.leases.stops(worker_id)
    return {"jobsToStop": stops} if stops else Response(status_code=204)


@router.get(BASE + "/ping/{worker_id}")
async def ping(endpoint: PingServed, worker_id: str, request: Request):
    # the SDK's heartbeat lists the jobs the worker holds: job_id=a,b
    held = request.query_params.get("job_id", "").split(",")
    endpoint.leases.heartbeat(worker_id, frozenset(j for j in held if j))
    return {}


@router.post(BASE + "/job-stream/{worker_id}/{job_id}")
async def job_stream(endpoint: WorkerServed, worker_id: str, job_id: str, request: Request):
    endpoint.leases.seen(worker_id)
    body = await json_body(request, RUNSYNC_BODY_LIMIT)
    await endpoint.leases.stream(worker_id, job_id, body)
    return {}


@router.post(BASE + "/job-done/{worker_id}/{job_id}")
async def job_done(endpoint: WorkerServed, worker_id: str, job_id: str, request: Request):
    now = endpoint.leases.seen(worker_id)
    body = await json_body(request, RUNSYNC_BODY_LIMIT)
    await endpoint.leases.result(worker_id, job_id, body, now)
    return {}
