"""The up/down/status commands of ``stack`` and ``cluster``, written once: both are groups of local processes
with a state folder, a status row per process and the variables that point OpenTinker at them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import typer
from rich.table import Table

from opentinker.cli.console import console

EnvOnly = Annotated[bool, typer.Option("--env", help="Print only the export lines (for `eval`).")]


@dataclass(frozen=True)
class Group:
    """One kind of service group, as the shared commands see it."""

    title: str
    item: str  # what a row is: "service", "node"
    where: str  # the column that says where a row answers
    open: Callable[[], Any]  # the group's runtime object (``Stack()``, ``LocalCluster()``)
    address: Callable[[Any], str]  # a status row -> its url or port
    env: Callable[[Any], dict[str, str]]  # the group -> OPENTINKER_* variables, empty when nothing runs
    use: Callable[[Any], str]  # the group -> how to use those variables
    empty: str  # status when nothing was ever started


def up(group: Group, label: str, start: Callable[[Any, Callable[[str], None]], object]) -> None:
    """Start the group under a spinner (``start(runtime, on_step)``), then print its status."""
    runtime = group.open()
    with console.status(label) as spinner:
        start(runtime, spinner.update)
    print_status(group, runtime)


def down(group: Group) -> None:
    """Stop what ``up`` started (and nothing else)."""
    stopped = group.open().down()
    console.print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


def status(group: Group, env_only: bool) -> None:
    """The status table, or with ``--env`` only the export lines."""
    runtime = group.open()
    if not env_only:
        print_status(group, runtime)
        return
    for key, value in group.env(runtime).items():
        console.print(f"export {key}={value}", markup=False, highlight=False)


def print_status(group: Group, runtime: Any) -> None:
    rows = runtime.status()
    if not rows:
        console.print(group.empty)
        return
    table = Table(title=f"{group.title} ({runtime.root})")
    for column in (group.item, "state", group.where, "pid"):
        table.add_column(column, no_wrap=True)
    for row in rows:
        state = "[green]running[/green]" if row.running else "[red]stopped[/red]"
        table.add_row(row.name, state, group.address(row), str(row.pid or ""))
    console.print(table)
    console.print("Logs (whole paths, one per line):", highlight=False)
    for row in rows:
        console.print(f"  {row.name}: {row.log}", markup=False, highlight=False)
    env = group.env(runtime)
    if env:
        console.print(f"Use it: {group.use(runtime)}", markup=False, highlight=False)
        for key, value in env.items():
            shown = "****" if "SECRET" in key else value
            console.print(f"  {key}={shown}", markup=False, highlight=False)
