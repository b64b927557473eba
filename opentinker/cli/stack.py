"""``opentinker stack up|down|status``: the local MLflow + Prefect + S3 services for users who want the UIs."""

from __future__ import annotations

from typing import Annotated

import typer

from opentinker.cli import services
from opentinker.cli.console import cli_errors

app = typer.Typer(
    help="Local services on loopback: SeaweedFS S3, MLflow server (artifacts on S3), Prefect server.",
    no_args_is_help=True,
)


def _stack():
    from opentinker.infra.stack import Stack

    return Stack()


STACK = services.Group(
    title="OpenTinker stack",
    item="service",
    where="url",
    open=_stack,
    address=lambda row: row.url if row.running else "",
    env=lambda stack: stack.env(),
    use=lambda stack: f"source {stack.env_path}  (or `eval $(opentinker stack status --env)`)",
    empty="no stack recorded; start it with `opentinker stack up`",
)


@app.command()
@cli_errors
def up(
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each service to answer.")] = 180.0,
    ui: Annotated[bool, typer.Option(help="Serve the Prefect UI.")] = True,
    backend: Annotated[str, typer.Option(help="MLflow backend store: sqlite or postgres.")] = "sqlite",
) -> None:
    """Start the stack on free loopback ports (a no-op when it already runs)."""
    services.up(
        STACK,
        "starting the stack",
        lambda stack, on_step: stack.up(
            timeout=timeout,
            ui=ui,
            backend=backend,
            on_step=lambda name: on_step(f"starting {name} (up to {timeout:.0f} s)"),
        ),
    )


@app.command()
@cli_errors
def down() -> None:
    """Stop the services that `stack up` started (and nothing else)."""
    services.down(STACK)


@app.command()
@cli_errors
def status(env: services.EnvOnly = False) -> None:
    """What runs where, the UI URLs, and the variables that point OpenTinker at the stack."""
    services.status(STACK, env)
