"""``/v1/internal``: workers fetch launches and watch for pending work (``worker`` scope); attempts report progress and
their result (with their token)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ..auth import Caller, require_scope
from ..launches import launch, pending_work, record_result, report_progress
from ..schemas import JobResult, LaunchInfo, LaunchRequest, PendingWork, ProgressReport

router = APIRouter(prefix="/v1/internal", tags=["internal"])
_job_token = HTTPBearer(auto_error=False, description="The job attempt's token (given to its trusted side at launch).")


@router.post("/launches", response_model=LaunchInfo)
def create_launch(
    body: LaunchRequest, request: Request, caller: Caller = Depends(require_scope("worker"))
) -> LaunchInfo:
    """The sandbox layout, environment and token of the job attempt behind a flow run; 404 when no unfinished job
    has that flow run (the worker then refuses to start it)."""
    info = launch(request.app.state.store, request.app.state.settings, body.flow_run_id, body.host)
    if info is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"flow run {body.flow_run_id}: no unfinished job")
    return info


@router.get("/pending", response_model=PendingWork)
def get_pending(request: Request, caller: Caller = Depends(require_scope("worker"))) -> PendingWork:
    """The queued and running jobs, which a worker polls instead of Prefect (``worker.py``)."""
    return pending_work(request.app.state.store)


@router.post("/jobs/{job_id}/progress", status_code=status.HTTP_204_NO_CONTENT)
def post_progress(
    job_id: str,
    body: ProgressReport,
    request: Request,
    token: HTTPAuthorizationCredentials | None = Depends(_job_token),
) -> None:
    """A running attempt's step, total and latest metrics (steps/s, mean return)."""
    if token is None or not report_progress(request.app.state.store, job_id, token.credentials, body):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id!r} not found")


@router.post("/jobs/{job_id}/result", status_code=status.HTTP_204_NO_CONTENT)
def post_result(
    job_id: str,
    body: JobResult,
    request: Request,
    token: HTTPAuthorizationCredentials | None = Depends(_job_token),
) -> None:
    """The attempt's typed result (run, model version, evaluation, gate decision), stored on the job."""
    if token is None or not record_result(request.app.state.store, job_id, token.credentials, body):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id!r} not found")
