"""``/v1/services``: policy services for a tenant's finished jobs, reachable behind the tenant's keys."""

from __future__ import annotations

import anyio.to_thread
import httpx
from fastapi import APIRouter, Depends, HTTPException, Request, status
from pydantic import BaseModel, ConfigDict, Field

from ..auth import Caller, require_scope
from ..db import Service
from ..errors import NotFound
from ..models import not_a_policy

router = APIRouter(prefix="/v1/services", tags=["services"])


class ServiceCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_id: str = Field(description="A SUCCEEDED job: its registered model version is served.")
    api_key_hash: str | None = Field(
        None, description="serving.auth.hash_api_key of a key of your choosing, for calling the service directly."
    )


class ServiceOut(BaseModel):
    id: str
    job_id: str | None
    model_name: str
    model_version: str
    url: str = Field(description="The service itself (POST /act with your own key); or use /v1/services/{id}/act.")


def _out(row: Service) -> ServiceOut:
    return ServiceOut.model_validate(row, from_attributes=True)


def _service(request: Request, caller: Caller, service_id: str) -> Service:
    row = request.app.state.services.get(caller.tenant, service_id)
    if row is None or row.stopped_at is not None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"service {service_id!r} not found")
    return row


@router.post("", response_model=ServiceOut, status_code=status.HTTP_201_CREATED)
async def create_service(
    body: ServiceCreate, request: Request, caller: Caller = Depends(require_scope("models"))
) -> ServiceOut:
    """Serve the registered model version of a finished job (a BentoML policy service on the server)."""
    jobs = request.app.state.jobs
    try:
        job = jobs.get(caller.tenant, body.job_id)
    except NotFound as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from None
    if job.state != "SUCCEEDED" or not job.result:
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job.id} is {job.state}: nothing registered to serve")
    if why := not_a_policy(job):
        raise HTTPException(status.HTTP_409_CONFLICT, why)
    row = await anyio.to_thread.run_sync(request.app.state.services.start, caller.tenant, job, body.api_key_hash)
    return _out(row)


@router.get("", response_model=list[ServiceOut])
def list_services(request: Request, caller: Caller = Depends(require_scope("models"))) -> list[ServiceOut]:
    return [_out(row) for row in request.app.state.services.list(caller.tenant)]


@router.delete("/{service_id}", response_model=ServiceOut)
def stop_service(service_id: str, request: Request, caller: Caller = Depends(require_scope("models"))) -> ServiceOut:
    row = _service(request, caller, service_id)
    request.app.state.services.stop(row)
    return _out(row)


@router.post("/{service_id}/act")
async def act(service_id: str, request: Request, caller: Caller = Depends(require_scope("models"))):
    """``/act`` of the service, called with a key of the tenant (the server forwards it with its own key)."""
    row = _service(request, caller, service_id)
    async with httpx.AsyncClient(timeout=30) as http:
        answer = await http.post(
            f"{row.url}/act",
            content=await request.body(),
            headers={"Authorization": f"Bearer {row.proxy_key}", "Content-Type": "application/json"},
        )
    if answer.status_code >= 400:
        raise HTTPException(answer.status_code, answer.json() if answer.content else answer.reason_phrase)
    return answer.json()
