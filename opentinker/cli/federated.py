"""`opentinker federated certs|up|down|run`: a loopback federation and runs on it (or in simulation)."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(
    help="Federated training through Flower: TLS certs, a loopback federation, runs.", no_args_is_help=True
)


@app.command()
def certs(
    directory: Path = typer.Option(..., "--dir", help="Folder for ca.crt, server.crt/key and site-<i>[.pub] keys."),
    sites: int = typer.Option(3, help="Sites to create auth key pairs for."),
    overwrite: bool = typer.Option(False, help="Replace existing certificates and keys."),
) -> None:
    """Self-signed CA + SuperLink certificate (127.0.0.1) + one SuperNode auth key pair per site."""
    from opentinker.federated.certs import generate_certs

    paths = generate_certs(directory, sites, overwrite=overwrite)
    typer.echo(f"certificates and {sites} site keys in {paths.directory}")


@app.command()
def up(
    sites: int = typer.Option(3, help="SuperNodes to start, one per site."),
    root: Path | None = typer.Option(None, help="Federation folder (default <data_dir>/federated/deployment)."),
    dataset: list[str] = typer.Option(
        [],
        help="SITE=PATH: site SITE trains by behaviour cloning on the .npz "
        "transitions at PATH instead of PPO (repeatable).",
    ),
    transport: str = typer.Option(
        "rest",
        help="How sites reach the SuperLink: 'rest' (Flower's Fleet API over HTTPS; passes firewalls that block gRPC).",
    ),
) -> None:
    """Start a SuperLink (TLS, SuperNode auth) and one authenticated SuperNode per site on loopback."""
    from opentinker.federated import deploy
    from opentinker.federated.api import apply_local_data
    from opentinker.federated.config import SiteConfig

    configs = [SiteConfig(site_id=i) for i in range(sites)]
    for item in dataset:
        site, sep, path = item.partition("=")
        if not sep or not site.isdigit() or int(site) >= sites:
            raise typer.BadParameter(
                f"{item!r}: expected SITE=PATH with SITE in 0..{sites - 1}", param_hint="--dataset"
            )
        apply_local_data(configs[int(site)], path, Path())
    fed = deploy.up(sites, root, site_configs=configs, transport=transport)
    typer.echo(f"SuperLink on {fed.address} (pid {fed.superlink_pid}); sites {fed.site_pids}; state in {fed.root}")


@app.command()
def down(root: Path | None = typer.Option(None, help="Federation folder given to `up`.")) -> None:
    """Stop every SuperNode and the SuperLink of a federation."""
    from opentinker.federated import deploy

    deploy.down(root)
    typer.echo("federation stopped")


@app.command()
def run(
    rounds: int = typer.Option(3, help="Aggregation rounds."),
    strategy: str = typer.Option("fedavg", help="fedavg | fedprox | fedadam."),
    sites: int = typer.Option(3, help="Sites in the federation (the completion floor is a fraction of it)."),
    min_completion_rate: float = typer.Option(0.66, help="Fraction of sites that must reply for a round to count."),
    aggregation_interval: float = typer.Option(30.0, help="Seconds of local training per round."),
    local_steps: int = typer.Option(4096, help="Max env steps per site per round."),
    run_name: str = typer.Option("federated", help="MLflow run name and checkpoint key (resume)."),
    simulate: bool = typer.Option(False, help="Use Flower's simulation engine instead of the deployed federation."),
    root: Path | None = typer.Option(None, help="Federation folder given to `up`."),
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
        typer.echo(
            f"round {entry['round']}: mean return {entry.get('return/mean', float('nan')):.1f} "
            f"({entry['round/seconds']:.1f}s, {int(entry['round/bytes_sent'])} B sent)"
        )
    typer.echo(f"{result.status}: model version {result.model_version or '-'}, MLflow run {result.mlflow_run_id}")
