"""``opentinker quickstart``: CartPole from training to one HTTP request, in one command."""

from __future__ import annotations

from typing import Annotated

import typer

from opentinker.cli.console import Verbose, cli_errors, console
from opentinker.cli.train import print_result, run_training

app = typer.Typer()

QUICKSTART_STEPS = 200_000
"""CartPole PPO with its preset (``presets.PPO_DISCRETE``) passes 475 after ~100–170k steps (docs/pipeline.md)."""


@app.command()
@cli_errors
def quickstart(
    steps: Annotated[int, typer.Option(help="Total env steps.")] = QUICKSTART_STEPS,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    verbose: Verbose = False,
) -> None:
    """Train CartPole-v1 on Ray, register it in MLflow, serve the champion and query it over HTTP."""
    from opentinker.flows.validate import checked_spec

    spec = checked_spec("CartPole-v1", None, steps=steps, seed=seed)
    result = run_training(spec, verbose)
    print_result(result)
    from opentinker.serving.deploy import query_once

    alias = "champion" if "champion" in result.aliases else "candidate"
    if alias != "champion":
        console.print("[yellow]This candidate did not become champion; serving it as the candidate instead.[/]")
    model_ref = f"models:/{result.model_name}@{alias}"
    with console.status(f"Starting a BentoML server for {model_ref} on loopback…"):
        served = query_once(model_ref, spec.env_id)
    console.print(f"Served at {served.url}: observation {served.observation} → action {served.action}")
    console.print(
        f"  the same request by hand: curl -X POST {served.url}/act -H 'Authorization: Bearer <api-key>' "
        f"-H 'Content-Type: application/json' -d '{{\"obs\": {served.observation}}}'",
        markup=False,
    )
    console.print("Server stopped.")
