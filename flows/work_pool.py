"""Run train_flow on a Prefect work pool: a process pool, a deployment pointing at this source tree, a worker.

`flow.serve` (``opentinker schedule``) runs deployments inside the serving process; a work pool decouples
submitting from executing: any number of ``prefect worker start --pool NAME --type process`` processes (on this
machine or others that have the same source tree and OPENTINKER_* settings) pick up runs as they come.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opentinker.tasks.spec import RunSpec

SOURCE_ROOT = Path(__file__).resolve().parent.parent
"""The folder above ``flows/``: the repository root in a checkout, the ``opentinker`` package folder when installed.
The process worker runs flows from this directory (local storage, no image, no network)."""
ENTRYPOINT = "flows/train.py:train_flow"


def ensure_process_pool(name: str) -> None:
    """Create the process work pool ``name`` unless it exists (idempotent, so every deploy can call it)."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
        except ObjectAlreadyExists:
            pool = client.read_work_pool(name)
            if pool.type != "process":
                raise ValueError(f"work pool {name!r}: expected type 'process', found {pool.type!r}") from None


def deploy_train_flow(pool: str, name: str, spec: RunSpec, cron: str | None = None) -> str:
    """Register a train_flow deployment of ``spec`` (resolved: its runs do not resolve it again) on ``pool``
    (created if missing); returns its id. ``cron`` adds a schedule (the server creates the runs, the pool's workers
    execute them)."""
    from prefect import Flow

    ensure_process_pool(pool)
    flow = Flow.from_source(source=str(SOURCE_ROOT), entrypoint=ENTRYPOINT)
    deployment_id = flow.deploy(
        name=name,
        work_pool_name=pool,
        parameters=_parameters(spec),
        cron=cron,
        build=False,
        push=False,
        print_next_steps=False,
    )
    return str(deployment_id)


def serve_train_flow(name: str, cron: str, spec: RunSpec, verbose: bool = False) -> None:
    """Serve a cron-scheduled train_flow deployment from this process until interrupted (``opentinker schedule``)."""
    from prefect.deployments.runner import EntrypointType

    from opentinker.flows.train import train_flow

    train_flow.serve(
        name=name,
        cron=cron,
        parameters=_parameters(spec),
        entrypoint_type=EntrypointType.MODULE_PATH,
        print_starting_message=verbose,
    )


def _parameters(spec: RunSpec) -> dict[str, Any]:
    """``train_flow``'s parameters as Prefect stores them (JSON; its runs validate them back into an equal spec)."""
    return {"spec": spec.model_dump(mode="json")}
