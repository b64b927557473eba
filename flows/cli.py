"""Pipeline commands: quickstart, train, schedule, evaluate, release.

Heavy packages (prefect, mlflow, ray, torch) are imported inside the commands so `opentinker --help`
stays fast. Expected failures (bad env id, bad config, unreachable storage) print one clear message
and exit 1; ``--verbose`` shows Prefect's logs and full tracebacks.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated

import typer

from opentinker.flows.console import console

QUICKSTART_STEPS = 200_000
"""CartPole PPO with its preset (``presets.PPO_DISCRETE``) passes 475 after ~100–170k steps (docs/pipeline.md)."""
Algo = Annotated[
    str | None,
    typer.Option(
        "--algo",
        help="Algorithm: ppo or dqn (default ppo); grpo trains an LLM "
        "agent's language model on a text task (arithmetic, tool_arithmetic).",
    ),
]

Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Show Prefect/MLflow logs and full tracebacks.")]


def _friendly_errors(command):
    """Turn expected failures into one red line and exit code 1 (tracebacks only with --verbose)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except typer.Exit:
            raise
        except Exception as exc:
            if kwargs.get("verbose"):
                raise
            console.print(f"[bold red]error:[/] {_describe(exc)}")
            raise typer.Exit(1) from None

    return wrapper


def _describe(exc: BaseException) -> str:
    from opentinker.flows.params import ConfigError

    if isinstance(exc, ConfigError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _load_params(env_id: str | None, config: Path | None, groups: bool = False, **overrides):
    """Params from config + flags, checked before any work: the env (``validate_env``), the engine config of the
    algorithm, and that the algorithm has a preset for the env's kind of problem.

    ``groups``: whether the command can run a multi-agent config (one with ``policy_mapping``).
    """
    from opentinker.flows.params import ConfigError, load_train_params
    from opentinker.flows.validate import check_env_id, check_presets

    params = load_train_params(config, env_id=env_id, **overrides)
    if not hasattr(params, "policy_mapping"):
        check_env_id(params.env_id)
        check_presets(params)
    elif not groups:  # group envs are PettingZoo envs, checked when the group is built
        raise ConfigError(
            "policy_mapping: this command deploys the single-agent train_flow; "
            "train an agent group with `opentinker train ENV --config FILE`"
        )
    return params


def _run_training(params, verbose: bool):
    from opentinker.flows.console import prepare_prefect, training_progress

    prepare_prefect(verbose)
    from opentinker.flows.train import run_train_flow

    with training_progress(params.steps, f"{params.algorithm.upper()} {params.env_id}"):
        return run_train_flow(params)


def _print_result(result) -> None:
    from opentinker.flows.console import ui_hints

    verdict = "[green]passed[/]" if result.passed_threshold else "[yellow]did NOT pass[/]"
    gate = "the threshold" if result.threshold is None else f"the threshold {result.threshold:g}"
    if result.threshold is None:
        gate = "the gate (no reward threshold for this env: beat the champion, or a random policy)"
    console.print(f"Evaluation: mean return {result.eval_mean:.1f} ± {result.eval_std:.1f} — {verdict} {gate}")
    from opentinker.tracking.runs import ui_url

    console.print(f"Model: {result.model_name} version {result.model_version} · aliases {', '.join(result.aliases)}")
    model_url = ui_url(f"models/{result.model_name}/versions/{result.model_version}")
    if model_url.startswith("http"):
        console.print(f"  {model_url}")
    console.print(f"Gate: {result.decision}")
    console.print(f"MLflow run: {result.run_id}\n  {result.run_url}")
    for hint in ui_hints():
        console.print(hint)


@_friendly_errors
def train(
    env_id: Annotated[
        str,
        typer.Argument(
            help="Gymnasium id (CartPole-v1), your env as package.module:Class, or a text task with --algo grpo."
        ),
    ],
    steps: Annotated[int | None, typer.Option(help="Total env steps (GRPO: optimiser steps).")] = None,
    algo: Algo = None,
    config: Annotated[Path | None, typer.Option(help="TOML or JSON file of TrainParams fields.")] = None,
    seed: Annotated[int | None, typer.Option(help="Random seed.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the run's last checkpoint.")] = False,
    verbose: Verbose = False,
) -> None:
    """Train a policy through the Prefect train_flow: rollouts, MLflow tracking, registry gate.

    Hyper-parameters come from the preset for the env's kind of problem; the ppo or dqn table of a config file
    overrides any field. A config file with ``policy_mapping`` trains an agent group instead (one registered model
    per kind); ``--algo grpo`` trains an LLM agent's LoRA adapter with GRPO on a text task (flows/llm_train.py).
    """
    if algo == "grpo":
        from opentinker.flows.llm_train import run_grpo_command

        run_grpo_command(env_id, config, steps=steps, seed=seed, resume=resume or None, verbose=verbose)
        return
    params = _load_params(env_id, config, groups=True, steps=steps, seed=seed, resume=resume or None, algorithm=algo)
    if hasattr(params, "policy_mapping"):
        _print_group_result(_run_group_training(params, verbose))
    else:
        _print_result(_run_training(params, verbose))


def _run_group_training(params, verbose: bool):
    from opentinker.flows.console import prepare_prefect

    prepare_prefect(verbose)
    from opentinker.flows.multiagent_flow import multiagent_train_flow

    with console.status(f"Training {', '.join(params.policy_mapping)} on {params.env_id} ({params.steps} env steps)"):
        return multiagent_train_flow(params)


def _print_group_result(result) -> None:
    from opentinker.flows.console import ui_hints

    for kind, evaluation in result.evaluation.items():
        model = result.models[kind]
        console.print(
            f"{kind}: mean return {evaluation.mean:.2f} ± {evaluation.std:.2f}, terminated "
            f"{evaluation.terminated_fraction:.0%} · model {model.name} version {model.version}"
        )
    console.print(f"MLflow run: {result.run_id}\n  {result.run_url}")
    for hint in ui_hints():
        console.print(hint)


@_friendly_errors
def quickstart(
    steps: Annotated[int, typer.Option(help="Total env steps.")] = QUICKSTART_STEPS,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    verbose: Verbose = False,
) -> None:
    """Train CartPole-v1 on Ray, register it in MLflow, serve the champion and query it over HTTP."""
    params = _load_params("CartPole-v1", None, steps=steps, seed=seed)
    result = _run_training(params, verbose)
    _print_result(result)
    from opentinker.flows.serve_demo import query_served_policy

    alias = "champion" if "champion" in result.aliases else "candidate"
    if alias != "champion":
        console.print("[yellow]This candidate did not become champion; serving it as the candidate instead.[/]")
    query_served_policy(f"models:/{result.model_name}@{alias}", params.env_id, console)


def _deployment_params(
    env_id: str, config: Path | None, steps: int | None, cron: str | None, verbose: bool, algo: str | None = None
):
    """What every train_flow deployment checks first: params, the cron (if any) and a Prefect server to hold it."""
    from opentinker.flows.console import prepare_prefect
    from opentinker.flows.validate import check_cron, check_prefect_server

    params = _load_params(env_id, config, steps=steps, algorithm=algo)
    prepare_prefect(verbose)
    if cron is not None:
        check_cron(cron)
    check_prefect_server()
    return params


@_friendly_errors
def schedule(
    env_id: Annotated[str, typer.Argument(help="Gymnasium id, e.g. CartPole-v1.")],
    cron: Annotated[str, typer.Option(help='Cron schedule, e.g. "0 3 * * *" for nightly at 03:00.')],
    steps: Annotated[int | None, typer.Option(help="Total env steps per run.")] = None,
    config: Annotated[Path | None, typer.Option(help="TOML or JSON file of TrainParams fields.")] = None,
    name: Annotated[str | None, typer.Option(help="Deployment name (default: nightly-<env>).")] = None,
    algo: Algo = None,
    verbose: Verbose = False,
) -> None:
    """Create a scheduled train_flow deployment and serve it from this process (Ctrl-C stops it)."""
    params = _deployment_params(env_id, config, steps, cron, verbose, algo)
    from prefect.deployments.runner import EntrypointType

    from opentinker.flows.train import train_flow

    deployment = name or f"nightly-{params.resolved_run_name}"
    console.print(
        f"Serving deployment [bold]train/{deployment}[/] on cron {cron!r}; trigger now with "
        f"`prefect deployment run train/{deployment}`. Ctrl-C stops."
    )
    train_flow.serve(
        name=deployment,
        cron=cron,
        parameters={"params": params.model_dump(mode="json")},
        entrypoint_type=EntrypointType.MODULE_PATH,
        print_starting_message=verbose,
    )


@_friendly_errors
def evaluate(
    model_uri: Annotated[str, typer.Argument(help="models:/NAME@alias, models:/NAME/VERSION or an export dir.")],
    episodes: Annotated[int, typer.Option(help="Deterministic episodes.")] = 10,
    seed: Annotated[int, typer.Option(help="Seed of the first episode.")] = 10_000,
    verbose: Verbose = False,
) -> None:
    """Evaluate a model on fixed seeds (cached per model version and seeds)."""
    from opentinker.flows.console import prepare_prefect
    from opentinker.flows.params import EvalParams

    prepare_prefect(verbose)
    from opentinker.flows.release import evaluate_flow

    result = evaluate_flow(EvalParams(model_uri=model_uri, episodes=episodes, seed=seed))
    cached = " (cached)" if result.cached else ""
    console.print(
        f"{result.model_key}: mean return {result.mean:.1f} ± {result.std:.1f} over {episodes} episodes{cached}"
    )


@_friendly_errors
def release(
    model_name: Annotated[str, typer.Argument(help="Registered model name.")],
    version: Annotated[str, typer.Option(help="Version number or alias to consider.")] = "candidate",
    threshold: Annotated[
        float | None,
        typer.Option(
            help="Minimum evaluation mean (default: the env spec's reward_threshold; none: beat the champion)."
        ),
    ] = None,
    episodes: Annotated[int, typer.Option(help="Deterministic episodes (same seeds for both).")] = 10,
    seed: Annotated[int, typer.Option(help="Seed of the first episode.")] = 10_000,
    verbose: Verbose = False,
) -> None:
    """Promotion gate: move `champion` to VERSION only if it beats the current champion on the same seeds."""
    from opentinker.flows.console import prepare_prefect

    prepare_prefect(verbose)
    from opentinker.flows.release import release_flow

    result = release_flow(model_name, version, episodes=episodes, seed=seed, threshold=threshold)
    console.print(f"{model_name} v{result.version}: {result.decision}")


def register(app: typer.Typer) -> None:
    """Called once from opentinker/cli.py."""
    for command in (quickstart, train, schedule, evaluate, release):
        app.command()(command)
