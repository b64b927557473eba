"""``opentinker federated certs|up|down|run``: a loopback federation and runs on it (or in simulation)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from opentinker.cli.console import cli_errors, console

app = typer.Typer(
    help="Federated training through Flower: TLS certs, a loopback federation, runs.", no_args_is_help=True
)

Root = Annotated[Path | None, typer.Option(help="Federation folder given to `up`.")]


@app.command()
@cli_errors
def certs(
    directory: Annotated[
        Path, typer.Option("--dir", help="Folder for ca.crt, server.crt/key and site-<i>[.pub] keys.")
    ],
    sites: Annotated[int, typer.Option(help="Sites to create auth key pairs for.")] = 3,
    overwrite: Annotated[bool, typer.Option(help="Replace existing certificates and keys.")] = False,
) -> None:
    """Self-signed CA + SuperLink certificate (127.0.0.1) + one SuperNode auth key pair per site."""
    from opentinker.federated.certs import generate_certs

    paths = generate_certs(directory, sites, overwrite=overwrite)
    console.print(f"certificates and {sites} site keys in {paths.directory}")


@app.command()
@cli_errors
def up(
    sites: Annotated[int, typer.Option(help="SuperNodes to start, one per site.")] = 3,
    root: Annotated[
        Path | None, typer.Option(help="Federation folder (default <data_dir>/federated/deployment).")
    ] = None,
    dataset: Annotated[
        list[str],
        typer.Option(
            help="SITE=PATH: site SITE trains by behaviour cloning on the .npz "
            "transitions at PATH instead of PPO (repeatable).",
        ),
    ] = [],  # noqa: B006 — typer needs a literal default
    transport: Annotated[
        str,
        typer.Option(
            help="How sites reach the SuperLink: 'rest' (Flower's Fleet API over HTTPS; passes firewalls that "
            "block gRPC)."
        ),
    ] = "rest",
) -> None:
    """Start a SuperLink (TLS, SuperNode auth) and one authenticated SuperNode per site on loopback."""
    from opentinker.federated import deploy
    from opentinker.federated.api import site_configs

    fed = deploy.up(sites, root, site_configs=site_configs(sites, dataset), transport=transport)
    console.print(f"SuperLink on {fed.address} (pid {fed.superlink_pid}); sites {fed.site_pids}; state in {fed.root}")


@app.command()
@cli_errors
def down(root: Root = None) -> None:
    """Stop every SuperNode and the SuperLink of a federation."""
    from opentinker.federated import deploy

    deploy.down(root)
    console.print("federation stopped")


@app.command()
@cli_errors
def run(
    rounds: Annotated[int, typer.Option(help="Aggregation rounds.")] = 3,
    strategy: Annotated[str, typer.Option(help="fedavg | fedprox | fedadam.")] = "fedavg",
    sites: Annotated[int, typer.Option(help="Sites in the federation (the completion floor is a fraction of it).")] = 3,
    min_completion_rate: Annotated[
        float, typer.Option(help="Fraction of sites that must reply for a round to count.")
    ] = 0.66,
    aggregation_interval: Annotated[float, typer.Option(help="Seconds of local training per round.")] = 30.0,
    local_steps: Annotated[int, typer.Option(help="Max env steps per site per round.")] = 4096,
    run_name: Annotated[str, typer.Option(help="MLflow run name and checkpoint key (resume).")] = "federated",
    simulate: Annotated[
        bool, typer.Option(help="Use Flower's simulation engine instead of the deployed federation.")
    ] = False,
    root: Root = None,
) -> None:
    """Run (or resume) a federated training run; prints the per-round mean return and the registered version."""
    from opentinker.federated.api import FLServer

    server = FLServer(
        strategy=strategy,
        rounds=rounds,
        num_sites=sites,
        min_completion_rate=min_completion_rate,
        aggregation_interval=aggregation_interval,
        local_steps=local_steps,
        run_name=run_name,
    )
    result = server.simulate() if simulate else server.run(root)
    for entry in result.history:
        console.print(
            f"round {entry['round']}: mean return {entry.get('return/mean', float('nan')):.1f} "
            f"({entry['round/seconds']:.1f}s, {int(entry['round/bytes_sent'])} B sent)"
        )
    console.print(f"{result.status}: model version {result.model_version or '-'}, MLflow run {result.mlflow_run_id}")
