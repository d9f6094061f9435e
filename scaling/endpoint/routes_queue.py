"""RunPod's public queue API on the local endpoint: /run, /runsync, /status, /stream, /cancel,
/purge-queue and /health, answered in the shapes RunPod documents.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from scaling.endpoint.protocol import (
    BASE,
    RUN_BODY_LIMIT,
    RUNSYNC_BODY_LIMIT,
    Served,
    job_input,
    json_body,
    public_job,
    submit,
    wait_ms,
)

STREAM_HOLD_S = 1.0  # /stream waits this long for a new chunk before answering with none

router = APIRouter()


@router.post(BASE + "/run")
async def run(endpoint: Served, request: Request):
    job = await submit(endpoint, job_input(await json_body(request, RUN_BODY_LIMIT)))
    return {"id": job.id, "status": job.status}


@router.post(BASE + "/runsync")
async def runsync(endpoint: Served, request: Request):
    wait_s = wait_ms(request) / 1000
    body = await json_body(request, RUNSYNC_BODY_LIMIT)
    job = await submit(endpoint, job_input(body), prefix="sync-")
    await endpoint.queue.wait_until(lambda: job.final, wait_s)
    return job.view() if job.final else {"id": job.id, "status": job.status}


@router.api_route(BASE + "/status/{job_id}", methods=["GET", "POST"])
async def status(endpoint: Served, job_id: str):
    return public_job(endpoint, job_id).view()


@router.api_route(BASE + "/stream/{job_id}", methods=["GET", "POST"])
async def stream(endpoint: Served, job_id: str):
    """The chunks streamed since the last /stream call (each handed out once)."""
    job = public_job(endpoint, job_id)
    await endpoint.queue.wait_until(
        lambda: job.final or len(job.stream) > job.stream_read, STREAM_HOLD_S
    )
    chunks = job.stream[job.stream_read :]
    job.stream_read += len(chunks)
    job.delivered = job.delivered or bool(chunks)
    out = {"id": job.id, "status": job.status, "stream": [{"output": c} for c in chunks]}
    if job.error is not None and job.final:
        out["error"] = job.error
    return out


@router.post(BASE + "/cancel/{job_id}")
async def cancel(endpoint: Served, job_id: str):
    job = public_job(endpoint, job_id)
    endpoint.queue.cancel(job)
    await endpoint.queue.notify()
    return {"id": job.id, "status": job.status}


@router.post(BASE + "/purge-queue")
async def purge(endpoint: Served):
    removed = endpoint.queue.purge()
    await endpoint.queue.notify()
    return {"removed": removed, "status": "completed"}


@router.get(BASE + "/health")
async def health(endpoint: Served):
    return endpoint.health()
