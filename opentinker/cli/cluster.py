"""``opentinker cluster up|down|status``: a multi-node Ray cluster on loopback (head + worker raylets)."""

from __future__ import annotations

from typing import Annotated

import typer

from opentinker.cli import services
from opentinker.cli.console import cli_errors

app = typer.Typer(
    help="A real multi-node Ray cluster on loopback; point OpenTinker at it with OPENTINKER_RAY_ADDRESS.",
    no_args_is_help=True,
)


def _cluster():
    from opentinker.infra.cluster import LocalCluster

    return LocalCluster()


CLUSTER = services.Group(
    title="Ray cluster",
    item="node",
    where="node manager port",
    open=_cluster,
    address=lambda row: str(row.node_manager_port),
    env=lambda cluster: {"OPENTINKER_RAY_ADDRESS": cluster.address} if cluster.address else {},
    use=lambda cluster: f"export OPENTINKER_RAY_ADDRESS={cluster.address}",
    empty="no cluster recorded; start one with `opentinker cluster up --nodes 2`",
)


@app.command()
@cli_errors
def up(
    nodes: Annotated[
        int, typer.Option(help="Nodes including the head; workers advertise the `rollout_node` resource.")
    ] = 2,
    cpus_per_node: Annotated[int, typer.Option(help="CPUs each node offers to Ray.")] = 1,
    object_store_mb: Annotated[int, typer.Option(min=64, help="Object store size per node (MiB).")] = 512,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each node.")] = 180.0,
    autoscale: Annotated[
        bool, typer.Option("--autoscale", help="Only the head; Ray's autoscaler adds up to NODES-1 workers on demand.")
    ] = False,
    idle_timeout_s: Annotated[
        float | None,
        typer.Option(help="With autoscaling: remove a worker idle this long (default: settings, else 60)."),
    ] = None,
) -> None:
    """Start a head and NODES-1 worker nodes, each `ray start --block` in its own process group."""
    from opentinker.infra.autoscale import start_cluster

    services.up(
        CLUSTER,
        "starting the Ray cluster",
        lambda cluster, on_step: start_cluster(
            cluster, nodes, cpus_per_node, object_store_mb, timeout, autoscale, idle_timeout_s
        ),
    )


@app.command()
@cli_errors
def down() -> None:
    """Stop the nodes that `cluster up` started (never other Ray instances on this machine)."""
    services.down(CLUSTER)


@app.command()
@cli_errors
def status(env: services.EnvOnly = False) -> None:
    """Nodes, their pids and logs, and the address to put in OPENTINKER_RAY_ADDRESS."""
    services.status(CLUSTER, env)
