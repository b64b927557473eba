"""``opentinker train|evaluate|release|schedule|publish``: the pipeline's flows, from a terminal."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import typer

from opentinker.cli.console import Verbose, cli_errors, console, print_ui_hints, training_progress
from opentinker.tasks import prepare_prefect

app = typer.Typer()

Algo = Annotated[
    str | None,
    typer.Option(
        "--algo",
        help="Algorithm: ppo, dqn, sac or td3 (default ppo); grpo trains an LLM agent's language model on a text "
        "env (a shipped task: arithmetic, tool_arithmetic; or your TextEnv as package.module:factory).",
    ),
]
Config = Annotated[Path | None, typer.Option(help="TOML or JSON file of RunSpec fields (docs/pipeline.md).")]
Episodes = Annotated[int, typer.Option(help="Deterministic episodes (same seeds for every model).")]
EvalSeed = Annotated[int, typer.Option(help="Seed of the first episode.")]


def run_training(spec, verbose: bool):
    """``train_flow`` on the (resolved) spec with a progress bar (also the quickstart's first step). A policy's
    training child starts first, before Prefect and MLflow are imported here (2-3 s of this process's start)."""
    from opentinker.tasks.training_process import start_early

    training = start_early(spec)
    try:
        prepare_prefect(verbose)
        from opentinker.flows.train import run_train_flow

        unit = "updates" if spec.algorithm == "grpo" else "env steps"
        with training_progress(spec.budget, f"{spec.algorithm.upper()} {spec.env_id} ({unit})"):
            return run_train_flow(spec, training)
    finally:
        if training is not None:  # stopped if this process failed before the flow adopted it; else nothing to do
            training.cancel()


def print_train_result(result) -> None:
    from opentinker.tracking.runs import ui_url

    verdict = "[green]passed[/]" if result.passed_threshold else "[yellow]did NOT pass[/]"
    gate = "the threshold" if result.threshold is None else f"the threshold {result.threshold:g}"
    if result.threshold is None:
        gate = "the gate (no reward threshold for this env: beat the champion, or a random policy)"
    other = "sampled" if result.eval_action == "greedy" else "greedy"
    other_mean = getattr(result, f"eval_{other}_mean")
    served = f"{result.eval_action} actions, as served"
    served += f"; {other}: {other_mean:.1f}" if other_mean is not None else ""
    console.print(
        f"Evaluation: mean return {result.eval_mean:.1f} ± {result.eval_std:.1f} ({served}) — {verdict} {gate}"
    )
    console.print(f"Model: {result.model_name} version {result.model_version} · aliases {', '.join(result.aliases)}")
    model_url = ui_url(f"models/{result.model_name}/versions/{result.model_version}")
    if model_url.startswith("http"):
        console.print(f"  {model_url}")
    console.print(f"Gate: {result.decision}")


def print_group_result(result) -> None:
    for kind, evaluation in result.evaluation.items():
        model = result.models[kind]
        console.print(
            f"{kind}: mean return {evaluation.mean:.2f} ± {evaluation.std:.2f}, terminated "
            f"{evaluation.terminated_fraction:.0%} · model {model.name} version {model.version}"
        )


def print_grpo_result(result) -> None:
    before = f"{result.base_eval.success:.1%} → " if result.base_eval else ""
    console.print(f"Held-out success: {before}{result.evaluation.success:.1%} over {result.evaluation.prompts} prompts")
    console.print(f"Model: {result.model_name} version {result.model_version} · aliases {', '.join(result.aliases)}")
    console.print(f"Gate: {result.decision}")
    console.print(
        f"Serve it: opentinker agent serve --llm models:/{result.model_name}@{result.aliases[-1]} "
        f"--tool python_repl --api-key KEY"
    )


def print_result(result) -> None:
    """A finished run of any algorithm: its evaluation, model(s), gate, and where to look."""
    if hasattr(result, "models"):
        print_group_result(result)
    elif hasattr(result, "base_eval"):
        print_grpo_result(result)
    else:
        print_train_result(result)
    console.print(f"MLflow run: {result.run_id}\n  {result.run_url}")
    print_ui_hints()


@app.command()
@cli_errors
def train(
    env_id: Annotated[
        str,
        typer.Argument(
            help="Gymnasium id (CartPole-v1), your env as package.module:Class, or a text env with --algo grpo."
        ),
    ],
    steps: Annotated[int | None, typer.Option(help="Total env steps (grpo: read as --updates).")] = None,
    updates: Annotated[int | None, typer.Option(help="GRPO: optimiser updates.")] = None,
    algo: Algo = None,
    config: Config = None,
    seed: Annotated[int | None, typer.Option(help="Random seed.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the run's last checkpoint.")] = False,
    verbose: Verbose = False,
) -> None:
    """Train through the Prefect train_flow: rollouts, MLflow tracking, registry gate.

    Hyper-parameters come from the preset for the env's kind of problem; the ppo or dqn table of a config file
    overrides any field. A config file with ``policy_mapping`` trains an agent group instead (one registered model
    per kind); ``--algo grpo`` trains an LLM agent's LoRA adapter with GRPO on a text env.
    """
    environment = dict(os.environ)  # before this command changes it: the warm flow process's key
    if not verbose and (code := in_warm_process(environment)) is not None:
        raise typer.Exit(code)
    from opentinker.flows.validate import checked_spec

    overrides = {"steps": steps, "updates": updates, "seed": seed, "resume": resume or None, "algorithm": algo}
    spec = checked_spec(env_id, config, groups=True, **overrides)
    print_result(run_training(spec, verbose))
    start_warm_process(environment)


def in_warm_process(environment: Mapping[str, str]) -> int | None:
    """This whole command run by a fork of the data dir's warm flow process (Prefect, MLflow and the flows already
    imported: ``tasks.fork_server.FLOW``) on this terminal: its exit status; None where none listens for this
    environment and code (this process runs it), and in that fork itself."""
    from opentinker.infra.settings import get_settings
    from opentinker.tasks import fork_server

    settings = get_settings()
    if fork_server.FORKED or settings.warm_process_idle_s <= 0:
        return None
    return fork_server.run_forked(settings.resolved_data_dir, fork_server.FLOW, "opentinker.cli", sys.argv, environment)


def start_warm_process(environment: Mapping[str, str]) -> None:
    """After a command that ran in this process, the data dir's warm flow process for the next one, started with the
    command's original ``environment`` (the one its key names)."""
    from opentinker.infra.settings import get_settings
    from opentinker.tasks import fork_server

    settings = get_settings()
    if not fork_server.FORKED:
        data_dir, idle_s = settings.resolved_data_dir, settings.warm_process_idle_s
        fork_server.start_server(data_dir, idle_s, fork_server.FLOW, environment)


@app.command()
@cli_errors
def evaluate(
    model_uri: Annotated[str, typer.Argument(help="models:/NAME@alias, models:/NAME/VERSION or an export dir.")],
    episodes: Episodes = 10,
    seed: EvalSeed = 10_000,
    verbose: Verbose = False,
) -> None:
    """Evaluate a model on fixed seeds (cached per model version and seeds)."""
    from opentinker.flows.params import EvalParams

    params = EvalParams(model_uri=model_uri, episodes=episodes, seed=seed)
    prepare_prefect(verbose)
    from opentinker.flows.release import evaluate_flow

    result = evaluate_flow(params)
    cached = " (cached)" if result.cached else ""
    console.print(
        f"{result.model_key}: mean return {result.mean:.1f} ± {result.std:.1f} over {episodes} episodes{cached}"
    )


@app.command()
@cli_errors
def release(
    model_name: Annotated[str, typer.Argument(help="Registered model name.")],
    version: Annotated[str, typer.Option(help="Version number or alias to consider.")] = "candidate",
    threshold: Annotated[
        float | None,
        typer.Option(
            help="Minimum evaluation mean (default: the env spec's reward_threshold; none: beat the champion)."
        ),
    ] = None,
    episodes: Episodes = 10,
    seed: EvalSeed = 10_000,
    verbose: Verbose = False,
) -> None:
    """Promotion gate: move `champion` to VERSION only if it beats the current champion on the same seeds."""
    prepare_prefect(verbose)
    from opentinker.flows.release import release_flow

    result = release_flow(model_name, version, episodes=episodes, seed=seed, threshold=threshold)
    console.print(f"{model_name} v{result.version}: {result.decision}")


def _deployment_spec(env_id: str, config: Path | None, steps: int | None, cron: str | None, algo, verbose: bool):
    from opentinker.flows.validate import check_deployment, checked_spec

    spec = checked_spec(env_id, config, steps=steps, algorithm=algo)
    prepare_prefect(verbose)  # reads prefect_api_url, which check_deployment needs
    check_deployment(cron)
    return spec


@app.command()
@cli_errors
def schedule(
    env_id: Annotated[str, typer.Argument(help="Gymnasium id, e.g. CartPole-v1.")],
    cron: Annotated[str, typer.Option(help='Cron schedule, e.g. "0 3 * * *" for nightly at 03:00.')],
    steps: Annotated[int | None, typer.Option(help="Total env steps per run.")] = None,
    config: Config = None,
    name: Annotated[str | None, typer.Option(help="Deployment name (default: nightly-<env>).")] = None,
    algo: Algo = None,
    verbose: Verbose = False,
) -> None:
    """Create a scheduled train_flow deployment and serve it from this process (Ctrl-C stops it)."""
    spec = _deployment_spec(env_id, config, steps, cron, algo, verbose)
    from opentinker.flows.work_pool import serve_train_flow

    deployment = name or f"nightly-{spec.resolved_run_name}"
    console.print(
        f"Serving deployment [bold]train/{deployment}[/] on cron {cron!r}; trigger now with "
        f"`prefect deployment run train/{deployment}`. Ctrl-C stops."
    )
    serve_train_flow(deployment, cron, spec, verbose)


@app.command()
@cli_errors
def publish(
    env_id: Annotated[str, typer.Argument(help="Gymnasium id (CartPole-v1) or package.module:Class.")],
    pool: Annotated[str, typer.Option(help="Process work pool (created if missing).")],
    cron: Annotated[str | None, typer.Option(help='Optional cron schedule, e.g. "0 3 * * *".')] = None,
    steps: Annotated[int | None, typer.Option(help="Total env steps per run.")] = None,
    config: Config = None,
    name: Annotated[str | None, typer.Option(help="Deployment name (default: <run name>).")] = None,
    algo: Algo = None,
    verbose: Verbose = False,
) -> None:
    """Publish train_flow as a Prefect deployment on a work pool; `prefect worker start --pool POOL --type process`
    runs it (``deploy``, the earlier name, still works; a model is served with `opentinker serve`)."""
    spec = _deployment_spec(env_id, config, steps, cron, algo, verbose)
    from opentinker.flows.work_pool import deploy_train_flow

    deployment = name or spec.resolved_run_name
    deploy_train_flow(pool, deployment, spec, cron=cron)
    console.print(
        f"Published [bold]train/{deployment}[/] to pool [bold]{pool}[/]. Start a worker with "
        f"`prefect worker start --pool {pool} --type process`; run now with "
        f"`prefect deployment run train/{deployment}`."
    )


app.command("deploy", hidden=True)(publish)  # the earlier name, as scripts type it


@app.command()
@cli_errors
def down() -> None:
    """Stop what `opentinker train` keeps running for this data dir: its Prefect server and its warm processes
    (the next run starts them)."""
    from opentinker.infra.local_prefect import stop_local_prefect
    from opentinker.infra.settings import get_settings
    from opentinker.tasks.fork_server import stop_servers

    stopped = stop_local_prefect()
    console.print("stopped the local Prefect server" if stopped else "no local Prefect server was running")
    if count := stop_servers(get_settings().resolved_data_dir):
        console.print(f"stopped the warm processes ({count})")
