"""``/v1/tenants``: tenants and their quotas. Admins see and set every tenant; a key sees its own tenant only."""

from __future__ import annotations

import sqlalchemy as sa
from fastapi import APIRouter, Depends, HTTPException, Request, status

from ..auth import Caller, current_caller, require_scope
from ..db import Tenant
from ..schemas import QuotasUpdate, TenantOut
from ..tenants import TenantError, check_name, set_quotas

router = APIRouter(prefix="/v1/tenants", tags=["tenants"])


def _out(row: Tenant) -> TenantOut:
    return TenantOut.model_validate(row, from_attributes=True)


@router.get("", response_model=list[TenantOut])
def list_tenants(request: Request, caller: Caller = Depends(require_scope("admin"))) -> list[TenantOut]:
    with request.app.state.store.session() as session:
        return [_out(row) for row in session.scalars(sa.select(Tenant).order_by(Tenant.name))]


@router.get("/{name}", response_model=TenantOut)
def read_tenant(name: str, request: Request, caller: Caller = Depends(current_caller)) -> TenantOut:
    """A tenant and its quotas: any tenant for an admin, else only the caller's own (others answer 404)."""
    with request.app.state.store.session() as session:
        row = session.get(Tenant, name)
        if row is None or (name != caller.tenant and "admin" not in caller.scopes):
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"tenant {name!r} not found")
        return _out(row)


@router.patch("/{name}", response_model=TenantOut)
def update_tenant(
    name: str, body: QuotasUpdate, request: Request, caller: Caller = Depends(require_scope("admin"))
) -> TenantOut:
    """Create the tenant (default quotas) if new, then change the quotas the body names."""
    try:
        check_name(name)
    except TenantError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from None
    with request.app.state.store.session() as session:
        tenant = _out(set_quotas(session, name, **body.model_dump(exclude_unset=True)))
    jobs = request.app.state.jobs
    if jobs is not None:
        jobs.apply_quotas(name)
    return tenant
