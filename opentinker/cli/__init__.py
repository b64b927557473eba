"""The ``opentinker`` command: every command group registered here, in one place.

Each module holds one group's commands; they parse options and call the areas' functions. Heavy packages
(prefect, mlflow, ray, torch, bentoml) are imported inside the commands so ``opentinker --help`` stays fast.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from opentinker.cli import agent, client, cluster, federated, quickstart, serve, server, stack, tinker, train

app = typer.Typer(
    help="OpenTinker: train, track, federate and serve RL agents.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)


def _print_version(value: bool) -> None:
    """``--version``: the installed distribution's version (its metadata), then exit."""
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        number = version("opentinker")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        from opentinker import __version__ as number
    typer.echo(f"opentinker {number}")
    raise typer.Exit()


@app.callback()
def _user_code_from_here(
    _version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Find the user's own env package (``pkg.module:Class``) in the folder the command runs from, as ``python -m``
    would: a console script's path holds its own folder instead. Appended, so installed packages keep precedence."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


app.add_typer(quickstart.app)
app.add_typer(train.app)
app.add_typer(serve.app)
app.add_typer(stack.app, name="stack")
app.add_typer(cluster.app, name="cluster")
app.add_typer(federated.app, name="federated")
app.add_typer(agent.app, name="agent")
app.add_typer(server.app, name="server")
app.add_typer(client.app)
app.add_typer(client.jobs_app, name="jobs")
app.add_typer(tinker.app, name="tinker")


def main(argv: list[str]) -> None:
    """``opentinker argv[1:]`` in a process that did not start as the console script: a fork of the data dir's warm
    flow process (``train.in_warm_process``)."""
    app(args=argv[1:], prog_name="opentinker")


__all__ = ["app", "main"]
