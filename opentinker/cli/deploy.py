"""`opentinker deploy`: register train_flow on a Prefect process work pool (run by `prefect worker start`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from opentinker.cli.train import Algo, Verbose, _deployment_params, _friendly_errors
from opentinker.cli.console import console


@_friendly_errors
def deploy(
    env_id: Annotated[str, typer.Argument(help="Gymnasium id (CartPole-v1) or package.module:Class.")],
    pool: Annotated[str, typer.Option(help="Process work pool (created if missing).")],
    cron: Annotated[str | None, typer.Option(help='Optional cron schedule, e.g. "0 3 * * *".')] = None,
    steps: Annotated[int | None, typer.Option(help="Total env steps per run.")] = None,
    config: Annotated[Path | None, typer.Option(help="TOML or JSON file of TrainParams fields.")] = None,
    name: Annotated[str | None, typer.Option(help="Deployment name (default: <run name>).")] = None,
    algo: Algo = None,
    verbose: Verbose = False,
) -> None:
    """Deploy train_flow to a work pool; a `prefect worker start --pool POOL --type process` runs it."""
    params = _deployment_params(env_id, config, steps, cron, verbose, algo)
    from opentinker.flows.work_pool import deploy_train_flow

    deployment = name or params.resolved_run_name
    deploy_train_flow(pool, deployment, {"params": params.model_dump(mode="json")}, cron=cron)
    console.print(
        f"Deployed [bold]train/{deployment}[/] to pool [bold]{pool}[/]. Start a worker with "
        f"`prefect worker start --pool {pool} --type process`; run now with "
        f"`prefect deployment run train/{deployment}`."
    )


def register(app: typer.Typer) -> None:
    """Called once from opentinker/cli.py."""
    app.command()(deploy)
