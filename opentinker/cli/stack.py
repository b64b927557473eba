"""``opentinker stack up|down|status``: the local MLflow + Prefect + S3 services for users who want the UIs."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    help="Local services on loopback: SeaweedFS S3, MLflow server (artifacts on S3), Prefect server.",
    no_args_is_help=True,
)
console = Console()


@app.command()
def up(
    timeout: float = typer.Option(180.0, help="Seconds to wait for each service to answer."),
    ui: bool = typer.Option(True, help="Serve the Prefect UI."),
    backend: str = typer.Option("sqlite", help="MLflow backend store: sqlite or postgres."),
) -> None:
    """Start the stack on free loopback ports (a no-op when it already runs)."""
    from opentinker.infra.stack import Stack, StackError

    stack = Stack()
    try:
        with console.status("starting the stack") as spinner:
            stack.up(
                timeout=timeout,
                ui=ui,
                backend=backend,
                on_step=lambda name: spinner.update(f"starting {name} (up to {timeout:.0f} s)"),
            )
    except StackError as exc:
        console.print(f"[red]stack up failed:[/red] {exc}")
        raise typer.Exit(1) from exc
    _print_status(stack)


@app.command()
def down() -> None:
    """Stop the services that `stack up` started (and nothing else)."""
    from opentinker.infra.stack import Stack

    stopped = Stack().down()
    console.print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


@app.command()
def status(env: bool = typer.Option(False, "--env", help="Print only the export lines (for `eval`).")) -> None:
    """What runs where, the UI URLs, and the variables that point OpenTinker at the stack."""
    from opentinker.infra.stack import Stack

    stack = Stack()
    if env:
        for key, value in stack.env().items():
            print(f"export {key}={value}")
        return
    _print_status(stack)


def _print_status(stack) -> None:
    table = Table(title=f"OpenTinker stack ({stack.root})")
    for column in ("service", "state", "url", "pid"):
        table.add_column(column, no_wrap=True)
    rows = stack.status()
    for row in rows:
        state = "[green]running[/green]" if row.running else "[red]stopped[/red]"
        table.add_row(row.name, state, row.url if row.running else "", str(row.pid or ""))
    console.print(table)
    console.print("Logs (whole paths, one per line):", highlight=False)
    for row in rows:
        console.print(f"  {row.name}: {row.log}", soft_wrap=True, highlight=False)
    env = stack.env()
    if env:
        console.print(f"Use it: [bold]source {stack.env_path}[/bold]  (or `eval $(opentinker stack status --env)`)")
        for key, value in env.items():
            shown = "****" if "SECRET" in key else value
            console.print(f"  {key}={shown}", highlight=False)
