"""``/v1/jobs``: submit, list, status, logs (follow), events (server-sent), cancel, resume, result.

Every route looks the job up by (tenant of the key, id): another tenant's job answers 404, like a job that never was.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import anyio.to_thread
from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response, status
from fastapi.responses import StreamingResponse
from fastapi.sse import EventSourceResponse, ServerSentEvent

from ..auth import Caller, require_scope
from ..channel import escape_controls
from ..db import Job
from ..errors import OverQuota, ServerError
from ..jobs import RETRY_AFTER_S, JobBoard
from ..schemas import FINAL_STATES, JobOut, JobResult, JobState, JobSubmit, LogLine

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
POLL_S = 0.25
"""How often a follow (logs) or an event stream looks for news."""
DOWNLOAD_CHUNK = 1 << 20
"""Bytes of a download read from disk at a time: what a download holds in the API's memory."""


def job_board(request: Request) -> JobBoard:
    jobs = request.app.state.jobs
    if jobs is None:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "this server runs no jobs (started with --no-jobs)")
    return jobs


def _errors(call):
    """The job board's errors as HTTP answers: 404, 422, 409, 429 with Retry-After."""
    try:
        return call()
    except ServerError as exc:
        retry_after = exc.retry_after or (RETRY_AFTER_S if isinstance(exc, OverQuota) else None)
        headers = {"Retry-After": f"{retry_after:g}"} if retry_after else None
        raise HTTPException(exc.status, exc.detail, headers=headers) from None


def readable_job(
    job_id: str, jobs: JobBoard = Depends(job_board), caller: Caller = Depends(require_scope("read"))
) -> Job:
    """The caller's tenant's job ``job_id`` (checked before a stream starts, so a wrong id is a plain 404)."""
    return _errors(lambda: jobs.get(caller.tenant, job_id))


@router.post("", response_model=JobOut, status_code=status.HTTP_201_CREATED)
async def submit_job(
    body: JobSubmit,
    response: Response,
    jobs: JobBoard = Depends(job_board),
    caller: Caller = Depends(require_scope("jobs")),
) -> JobOut:
    """Queue a training job. Over a quota: 429 naming it, with Retry-After; bad spec: 422 naming the field. The same
    ``idempotency_key`` again answers 200 with the job it made the first time."""
    job, created = await anyio.to_thread.run_sync(lambda: _errors(lambda: jobs.submit(caller.tenant, body)))
    if not created:
        response.status_code = status.HTTP_200_OK
    return jobs.view(job)


@router.get("", response_model=list[JobOut])
def list_jobs(
    state: JobState | None = None,
    limit: int = Query(100, ge=1, le=1000),
    jobs: JobBoard = Depends(job_board),
    caller: Caller = Depends(require_scope("read")),
) -> list[JobOut]:
    """The tenant's jobs, newest first."""
    return [jobs.view(job) for job in jobs.list(caller.tenant, state, limit)]


@router.get("/{job_id}", response_model=JobOut)
async def job_status(
    job_id: str, jobs: JobBoard = Depends(job_board), caller: Caller = Depends(require_scope("read"))
) -> JobOut:
    """State; while queued its position and what it waits for, while running step / total, steps/s, return, ETA."""
    return await _current_view(jobs, caller.tenant, job_id)


async def _current_view(jobs: JobBoard, tenant: str, job_id: str) -> JobOut:
    """The shared view of the job: from the loop while fresh, else read in a thread (404 for another tenant's)."""
    fresh = jobs.fresh_view(tenant, job_id)
    if fresh is not None:
        return fresh
    return await anyio.to_thread.run_sync(lambda: _errors(lambda: jobs.cached_view(tenant, job_id)))


@router.post("/{job_id}/cancel", response_model=JobOut)
def cancel_job(
    job_id: str, jobs: JobBoard = Depends(job_board), caller: Caller = Depends(require_scope("jobs"))
) -> JobOut:
    """Stop the job (its processes and Ray work within seconds); its checkpoints stay for a resume."""
    return jobs.view(_errors(lambda: jobs.cancel(caller.tenant, job_id)))


@router.post("/{job_id}/resume", response_model=JobOut)
def resume_job(
    job_id: str, jobs: JobBoard = Depends(job_board), caller: Caller = Depends(require_scope("jobs"))
) -> JobOut:
    """Queue a cancelled or failed job again; it continues from its last checkpoint."""
    return jobs.view(_errors(lambda: jobs.resume(caller.tenant, job_id)))


@router.get("/{job_id}/result", response_model=JobResult)
def job_result(job: Job = Depends(readable_job)) -> JobResult:
    """The finished job's MLflow run, registered model version, aliases and gate decision (409 until SUCCEEDED)."""
    if job.state != "SUCCEEDED" or not job.result:
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job.id} is {job.state}: no result yet")
    return job.result


@router.get("/{job_id}/policy", response_class=Response, responses={200: {"content": {"application/gzip": {}}}})
async def job_policy(request: Request, job: Job = Depends(readable_job)) -> Response:
    """The finished job's registered policy (``policy.json`` + ``weights.npz``, numpy only) as a ``.tar.gz``, streamed
    from disk ``DOWNLOAD_CHUNK`` bytes at a time (the API's memory stays flat whatever the export's size)."""
    from ..models import not_a_policy, policy_archive

    if job.state != "SUCCEEDED" or not job.result:
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job.id} is {job.state}: no registered policy yet")
    if why := not_a_policy(job):
        raise HTTPException(status.HTTP_409_CONFLICT, why)
    archive = await anyio.to_thread.run_sync(policy_archive, job, request.app.state.settings)

    async def chunks() -> AsyncIterator[bytes]:
        try:
            while chunk := await anyio.to_thread.run_sync(archive.read, DOWNLOAD_CHUNK):
                yield chunk
        finally:
            archive.close()

    size = str(os.fstat(archive.fileno()).st_size)
    return StreamingResponse(chunks(), media_type="application/gzip", headers={"Content-Length": size})


@router.get(
    "/{job_id}/logs", response_class=StreamingResponse, responses={200: {"content": {"application/x-ndjson": {}}}}
)
async def job_logs(
    follow: bool = False,
    offset: int = Query(0, ge=0),
    job: Job = Depends(readable_job),
    jobs: JobBoard = Depends(job_board),
) -> StreamingResponse:
    """The job's log lines (its flow and task runs, from Prefect) as JSON lines; ``follow`` keeps the stream open
    until the job ends. A client that goes away stops only its stream, never the job."""

    async def lines() -> AsyncIterator[bytes]:
        seen, current = offset, job
        while True:
            flow_run_id = current.flow_run_id
            batch = await anyio.to_thread.run_sync(jobs.orchestrator.logs, flow_run_id, seen) if flow_run_id else []
            for log in batch:
                message = escape_controls(log.message, keep="\t\n")  # the attempt escaped the job's; older logs too
                line = LogLine(timestamp=log.timestamp, level=log.level, name=log.name, message=message)
                yield (line.model_dump_json() + "\n").encode()
            seen += len(batch)
            if batch:
                continue
            if not follow or current.state in FINAL_STATES:
                return
            await asyncio.sleep(POLL_S)
            current = await anyio.to_thread.run_sync(jobs.get, job.tenant, job.id)
            if current.flow_run_id != flow_run_id:
                seen = 0  # a new attempt: its own flow run and log

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.get("/{job_id}/events", response_class=EventSourceResponse)
async def job_events(
    job: Job = Depends(readable_job), jobs: JobBoard = Depends(job_board)
) -> AsyncIterator[ServerSentEvent]:
    """Server-sent events: a ``status`` event (the job as ``GET /v1/jobs/{id}`` shows it) whenever it changes, and an
    ``end`` event once it is final."""
    last, seen = None, None
    while True:
        view = await _current_view(jobs, job.tenant, job.id)
        if view is not seen:  # the shared view is a new object only when it was read again
            seen, payload = view, view.model_dump(mode="json")
            if payload != last:
                yield ServerSentEvent(data=payload, event="status")
                last = payload
        if view.state in FINAL_STATES:
            yield ServerSentEvent(data={"state": view.state}, event="end")
            return
        await asyncio.sleep(POLL_S)
