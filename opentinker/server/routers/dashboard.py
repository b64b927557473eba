"""``/v1/dashboard``: where the caller's tenant looks at its runs, curves, artifacts and models — the MLflow UI, as
the tenant's own MLflow user (``mlflow_users``), whose permissions MLflow itself enforces."""

from __future__ import annotations

import anyio.to_thread
from fastapi import APIRouter, Depends, HTTPException, Request, status

from opentinker.tracking.runs import UI_QUERY

from .. import mlflow_users, tenants
from ..auth import Caller, require_scope
from ..schemas import Dashboard

router = APIRouter(prefix="/v1/dashboard", tags=["dashboard"])

EMBEDDED = (
    "this server keeps each tenant's runs in its own MLflow store on the server's machine, which only its operator "
    "can open; per-tenant dashboards need an MLflow server with its authentication app (mlflow_tracking_uri and "
    "mlflow_admin_username: docs/deploy.md)"
)


@router.get("", response_model=Dashboard)
async def dashboard(request: Request, caller: Caller = Depends(require_scope("read"))) -> Dashboard:
    """The MLflow UI of the caller's tenant and the tenant's MLflow user to open it with (basic auth): its own
    experiment, runs and registered models, and nothing of another tenant's (MLflow answers 403). 409 on a server
    without an MLflow server with users (the embedded stack)."""
    settings = request.app.state.settings
    if not mlflow_users.enabled(settings):
        raise HTTPException(status.HTTP_409_CONFLICT, EMBEDDED)
    try:
        experiment_id = await anyio.to_thread.run_sync(
            mlflow_users.identities(settings).ensure_experiment, caller.tenant
        )
    except mlflow_users.MlflowIdentityError as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, str(exc)[:500]) from exc
    creds = mlflow_users.credentials(caller.tenant, settings)
    url = (settings.mlflow_ui_url or settings.mlflow_tracking_uri).rstrip("/")
    return Dashboard(
        url=url,
        experiment=tenants.experiment(caller.tenant),
        experiment_id=experiment_id,
        experiment_url=f"{url}/#/experiments/{experiment_id}{UI_QUERY}",
        models_url=f"{url}/#/models{UI_QUERY}",
        username=creds.username,
        password=creds.password,
    )
