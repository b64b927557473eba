"""``opentinker cluster up|down|status``: a multi-node Ray cluster on loopback (head + worker raylets)."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    help="A real multi-node Ray cluster on loopback; point OpenTinker at it with OPENTINKER_RAY_ADDRESS.",
    no_args_is_help=True,
)
console = Console()


@app.command()
def up(
    nodes: int = typer.Option(
        2, min=1, help="Nodes including the head; workers advertise the `rollout_node` resource."
    ),
    cpus_per_node: int = typer.Option(1, min=1, help="CPUs each node offers to Ray."),
    object_store_mb: int = typer.Option(512, min=64, help="Object store size per node (MiB)."),
    timeout: float = typer.Option(180.0, help="Seconds to wait for each node."),
    autoscale: bool = typer.Option(
        False, "--autoscale", help="Only the head; Ray's autoscaler adds up to NODES-1 workers for pending actors."
    ),
    idle_timeout_s: float | None = typer.Option(
        None, help="With --autoscale: remove a worker idle this long (default: settings, else 60)."
    ),
) -> None:
    """Start a head and NODES-1 worker nodes, each `ray start --block` in its own process group."""
    from opentinker.infra.autoscale import start_cluster
    from opentinker.infra.cluster import ClusterError

    try:
        with console.status("starting the Ray cluster"):
            cluster = start_cluster(nodes, cpus_per_node, object_store_mb, timeout, autoscale, idle_timeout_s)
    except ClusterError as exc:
        console.print(f"[red]cluster up failed:[/red] {exc}")
        raise typer.Exit(1) from exc
    _print_status(cluster)


@app.command()
def down() -> None:
    """Stop the nodes that `cluster up` started (never other Ray instances on this machine)."""
    from opentinker.infra.cluster import LocalCluster

    stopped = LocalCluster().down()
    console.print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


@app.command()
def status(env: bool = typer.Option(False, "--env", help="Print only the export line (for `eval`).")) -> None:
    """Nodes, their pids and logs, and the address to put in OPENTINKER_RAY_ADDRESS."""
    from opentinker.infra.cluster import LocalCluster

    cluster = LocalCluster()
    if env:
        if cluster.address:
            print(f"export OPENTINKER_RAY_ADDRESS={cluster.address}")
        return
    _print_status(cluster)


def _print_status(cluster) -> None:
    table = Table(title=f"Ray cluster ({cluster.root})")
    for column in ("node", "state", "pid", "node manager port", "log"):
        table.add_column(column)
    rows = cluster.status()
    for row in rows:
        state = "[green]running[/green]" if row.running else "[red]stopped[/red]"
        table.add_row(row.name, state, str(row.pid or ""), str(row.node_manager_port), row.log)
    console.print(table if rows else "no cluster recorded; start one with `opentinker cluster up --nodes 2`")
    if cluster.address:
        console.print(f"Use it: [bold]export OPENTINKER_RAY_ADDRESS={cluster.address}[/bold]", highlight=False)
