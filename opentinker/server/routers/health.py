"""``GET /healthz``: the only route without a key (load balancers and `server up` poll it)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from opentinker import __version__

from ..schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz(request: Request) -> Health:
    return Health(version=__version__, jobs=request.app.state.jobs is not None)
