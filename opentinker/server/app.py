"""``create_app()``: the server's ASGI app, one router per resource, the key check as a dependency on every route but
``/healthz`` (FastAPI's "bigger applications" layout).

Why FastAPI rather than BentoML's ASGI mounting: this app is a control plane (typed JSON resources, streaming logs
and server-sent events, a dependency that authenticates every route), not a model runner; BentoML's value, adaptive
batching and model packaging, stays in the policy services the server starts. FastAPI is already in the locked set
(Flower pins 0.138, which has native SSE), and its OpenAPI schema is the API reference in docs/service.md.
"""

from __future__ import annotations

import gc
import tempfile
from contextlib import asynccontextmanager

import anyio.to_thread
from fastapi import FastAPI, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from opentinker import __version__
from opentinker.infra.settings import Settings, get_settings
from opentinker.serving.middleware import BodyLimitMiddleware

from .db import Store
from .keys import KeyRing
from .models import Services
from .routers import dashboard, health, internal, keys, services, tenants, tinker, uploads
from .routers import jobs as jobs_router


def create_app(settings: Settings | None = None, jobs: bool = True) -> FastAPI:
    """The server's app on the settings' database. With ``jobs`` it runs training jobs on Prefect (the settings'
    ``prefect_api_url`` must name a Prefect server); without, it serves keys, tenants and what needs no Prefect."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.store = Store(settings.server_database)
        app.state.keyring = KeyRing(app.state.store)
        app.state.settings = settings
        app.state.jobs = None
        app.state.services = Services(app.state.store, settings)
        sync = None
        if jobs:
            # In a thread: Prefect's sync-or-async calls (Flow.from_source, ...) would return coroutines in the loop.
            app.state.jobs, sync = await anyio.to_thread.run_sync(_job_machinery, app.state.store, settings)
            sync.start()
        await anyio.to_thread.run_sync(_settle_heap, settings)
        try:
            yield
        finally:
            if sync is not None:
                sync.stop()
                app.state.jobs.orchestrator.close()
            app.state.store.close()

    app = FastAPI(
        title="OpenTinker",
        version=__version__,
        summary="Reinforcement learning as a service: training jobs, models and the Tinker API, per tenant.",
        lifespan=lifespan,
    )
    app.add_exception_handler(RequestValidationError, _one_line_validation_error)
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=int(settings.server_max_upload_mb * 1024 * 1024), error_field="detail"
    )
    for module in (health, keys, tenants, jobs_router, uploads, services, dashboard, internal, tinker):
        app.include_router(module.router)
    return app


def _settle_heap(settings: Settings) -> None:
    """Load what the server uses soon anyway (MLflow and, on the embedded stack, its SQLite store, for results and
    models), then freeze the heap built so far (~0.5 M objects: modules, the app, Prefect's and pydantic's machinery)
    out of the garbage collector's reach. A full collection walked all of it holding the GIL: 0.2-0.4 s in which no
    request was answered, the tail of bench/service.py (c)."""
    import mlflow

    if not settings.mlflow_tracking_uri:  # the tenants' stores are SQLite: its engine and migrations, once
        with tempfile.TemporaryDirectory() as folder:
            mlflow.MlflowClient(tracking_uri=f"sqlite:///{folder}/warm-up.db").search_experiments()
    gc.collect()
    gc.freeze()


def _job_machinery(store: Store, settings: Settings):
    """The Prefect side (pool, deployment, one queue per tenant with its running-jobs quota) and the sync loop."""
    from .env_check import EnvCheck
    from .jobs import JobBoard
    from .orchestration import Orchestrator
    from .sync import JobSync

    if not settings.prefect_api_url:
        raise RuntimeError(
            "prefect_api_url: a server that runs jobs needs a Prefect server (opentinker server up starts one)"
        )
    orchestrator = Orchestrator(settings.prefect_api_url)
    orchestrator.setup(pool_limit=settings.server_pool_limit)
    service = JobBoard(store, orchestrator, EnvCheck(settings), settings)
    return service, JobSync(store, orchestrator, settings, hand_off=service.hand_off_later)


async def _one_line_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 whose ``detail`` is one line per problem naming the field (``body.steps: ...``), as the CLI prints it."""
    lines = []
    for error in exc.errors():
        loc = [str(part) for part in error["loc"] if part != "body"]
        field = ".".join(loc) or "body"
        message = "unknown field" if error["type"] == "extra_forbidden" else error["msg"].removeprefix("Value error, ")
        lines.append(f"{field}: {message}")
    return JSONResponse({"detail": "; ".join(lines)}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)
