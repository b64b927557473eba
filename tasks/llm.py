"""GRPO stages for the language-model agent: probe the text task, train (Ray rollouts, MLflow metrics per step),
evaluate the adapter on held-out prompts (with a table of sample episodes), register it, gate the champion."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from opentinker.tasks.spec import RunSpec
from opentinker.tasks.train import spec_dir
from opentinker.tracking.runs import MetricsLogger, configure_mlflow


class LLMEvaluation(BaseModel):
    """Greedy episodes on the first ``prompts`` held-out examples."""

    success: float
    mean_reward: float
    valid_tool_call_rate: float
    response_tokens: float
    prompts: int


class GRPOTrainOutcome(BaseModel):
    run_id: str
    checkpoint_path: str
    adapter_dir: str
    start_update: int
    updates: int
    train_seconds: float
    completions: int
    completions_per_s: float
    base_eval: LLMEvaluation | None


def _evaluation(result: Any, prompts: int) -> LLMEvaluation:
    return LLMEvaluation(
        success=result.success,
        mean_reward=result.mean_reward,
        valid_tool_call_rate=result.valid_tool_call_rate,
        response_tokens=result.mean_response_tokens,
        prompts=prompts,
    )


def log_episode_table(run_id: str, episodes: list, step: int, name: str = "eval") -> None:
    """A table of sample episodes (prompt, tool calls and results, answer, reward) as an MLflow artifact."""
    import json

    import mlflow

    rows: dict[str, list] = {
        "prompt": [],
        "tool_calls": [],
        "tool_results": [],
        "answer": [],
        "reward": [],
        "success": [],
    }
    for episode in episodes:
        assistant = [t["content"] for t in episode.transcript if t["role"] == "assistant"]
        results = [t["content"] for t in episode.transcript[1:] if t["role"] == "user"]
        rows["prompt"].append(episode.prompt)
        rows["tool_calls"].append(json.dumps(assistant[:-1]))
        rows["tool_results"].append(json.dumps(results))
        rows["answer"].append(assistant[-1] if assistant else "")
        rows["reward"].append(episode.reward)
        rows["success"].append(bool(episode.success))
    mlflow.MlflowClient().log_table(run_id, data=rows, artifact_file=f"episodes/{name}_step_{step:06d}.json")


def log_evaluation(run_id: str, result: Any, step: int, name: str = "eval") -> None:
    import mlflow

    client = mlflow.MlflowClient()
    for key, value in (
        ("success_rate", result.success),
        ("reward_mean", result.mean_reward),
        ("valid_tool_call_rate", result.valid_tool_call_rate),
        ("response_tokens", result.mean_response_tokens),
    ):
        client.log_metric(run_id, f"{name}/{key}", float(value), step=step)
    log_episode_table(run_id, result.episodes, step, name)


@task(cache_policy=NO_CACHE)
def probe_text_env(env_id: str, task_seed: int) -> int:
    """``validate_env`` on both splits of the text env (shipped or ``module:factory``) before any service or model
    starts; returns the train split's size."""
    from opentinker.envs.text_tasks import SPLITS, make_text_env
    from opentinker.envs.validation import validate_env

    for split in SPLITS:
        validate_env(make_text_env(env_id, split, task_seed))
    return len(make_text_env(env_id, "train", task_seed).examples)


def grpo_trainer(spec: RunSpec, checkpoint: Path | None) -> Any:
    """``spec``'s GRPO trainer, resumed from ``checkpoint`` when it exists, else new."""
    from opentinker.agents.grpo_trainer import GRPO

    grpo = spec.engine
    if checkpoint is not None and checkpoint.exists():
        return GRPO.load(checkpoint, workers=grpo.workers, backend=grpo.backend)
    return GRPO(grpo.config(task=spec.env_id), seed=spec.seed, workers=grpo.workers, backend=grpo.backend)


@task(cache_policy=NO_CACHE)
def train_grpo(run_id: str, spec: RunSpec) -> GRPOTrainOutcome:
    """GRPO until ``spec.engine.updates`` optimiser updates; held-out success of the base first (update 0) and every
    ``eval_every`` updates."""
    from opentinker.agents.checkpoint import CHECKPOINT_NAME

    grpo = spec.engine
    root = spec_dir(spec)
    checkpoint = root / "checkpoints" / CHECKPOINT_NAME
    configure_mlflow()
    trainer = grpo_trainer(spec, checkpoint if spec.resume else None)
    try:
        start_update, start_completions = trainer.updates, trainer.completions
        base_eval = None
        if start_update == 0:
            result = trainer.evaluate(base=True)
            log_evaluation(run_id, result, 0)
            base_eval = _evaluation(result, trainer.config.eval_prompts)
        logger = MetricsLogger.with_progress(run_id, grpo.updates)

        def callback(metrics: dict[str, float], update: int) -> None:
            logger(metrics, update)
            if grpo.eval_every and update % grpo.eval_every == 0 and update < grpo.updates:
                log_evaluation(run_id, trainer.evaluate(), update)

        started = time.perf_counter()
        trainer.train(
            grpo.updates, callback=callback, checkpoint_dir=checkpoint.parent, checkpoint_every=spec.checkpoint_every
        )
        train_seconds = time.perf_counter() - started
        logger.flush()
        adapter_dir = trainer.save_adapter(root / "adapter", run_id=run_id)
        done = trainer.completions - start_completions
        return GRPOTrainOutcome(
            run_id=run_id,
            checkpoint_path=str(checkpoint),
            adapter_dir=str(adapter_dir),
            start_update=start_update,
            updates=trainer.updates,
            train_seconds=train_seconds,
            completions=done,
            completions_per_s=done / max(train_seconds, 1e-9),
            base_eval=base_eval,
        )
    finally:
        trainer.close()


@task(cache_policy=NO_CACHE)
def evaluate_adapter(
    adapter_dir: str,
    prompts: int,
    eval_batch: int = 16,
    cache_dir: str | None = None,
    run_id: str | None = None,
    step: int = 0,
) -> LLMEvaluation:
    """The saved adapter on its base model, greedy, on the first ``prompts`` held-out examples of the adapter's own
    task, through the sampler GRPO's workers use. Logged (metrics + episode table) when ``run_id`` is given."""
    from opentinker.agents.grpo_trainer import summarise
    from opentinker.agents.lm_rollout import POLICY, adapter_sampler, evaluate_model

    sampler, meta = adapter_sampler(adapter_dir, cache_dir)
    episodes = evaluate_model(
        sampler, POLICY, meta["task"], meta["task_seed"], list(range(prompts)), meta["max_new_tokens"], eval_batch
    )
    result = summarise(episodes)
    if run_id:
        configure_mlflow()
        log_evaluation(run_id, result, step, "heldout")
    return _evaluation(result, prompts)


@task(cache_policy=NO_CACHE)
def register_adapter(run_id: str, adapter_dir: str, model_name: str, base_model: str, task_name: str) -> str:
    """A new version of ``model_name`` holding the adapter, tagged with its base model; alias ``candidate``."""
    from opentinker.tracking.llm_store import log_adapter_model
    from opentinker.tracking.registry import set_alias

    version = log_adapter_model(
        adapter_dir, run_id, model_name, {"base_model": base_model, "task": task_name, "algorithm": "grpo"}
    )
    set_alias(model_name, "candidate", version)
    return version


class GateDecision(BaseModel):
    version: str
    aliases: list[str]
    decision: str
    champion_success: float | None


def decide_adapter(
    model_name: str,
    version: str,
    candidate: LLMEvaluation,
    champion: Any,
    champion_success: float | None,
    threshold: float = 0.0,
) -> GateDecision:
    """Move ``champion`` to ``version`` only if its held-out success reaches ``threshold`` and beats the current
    champion's (``champion_success``, measured on the same prompts; None: no champion to beat)."""
    from opentinker.tracking.registry import set_alias

    if candidate.success < threshold:
        decision = f"kept champion: success {candidate.success:.3f} below threshold {threshold:.3f}"
    elif champion_success is not None and candidate.success <= champion_success:
        decision = (
            f"kept champion v{champion.version}: success {candidate.success:.3f} does not beat "
            f"{champion_success:.3f} on the same {candidate.prompts} prompts"
        )
    else:
        set_alias(model_name, "champion", version)
        decision = f"promoted v{version} to champion" + (
            f" (success {candidate.success:.3f} > {champion_success:.3f})"
            if champion_success is not None
            else " (first champion)"
        )
    aliases = ["candidate"] + (["champion"] if decision.startswith("promoted") else [])
    return GateDecision(version=version, aliases=aliases, decision=decision, champion_success=champion_success)


@task(cache_policy=NO_CACHE)
def gate_adapter(
    model_name: str,
    version: str,
    candidate: LLMEvaluation,
    threshold: float = 0.0,
    eval_batch: int = 16,
    cache_dir: str | None = None,
) -> GateDecision:
    """The gate of ``decide_adapter``, with the champion re-evaluated here on the candidate's prompts (not trusted
    from its run)."""
    from opentinker.tracking.llm_store import download_adapter
    from opentinker.tracking.registry import PolicyStoreError

    champion_success = None
    try:
        ref, folder = download_adapter(f"models:/{model_name}@champion")
    except PolicyStoreError:
        ref = None
    if ref is not None and ref.version != version:
        champion_success = evaluate_adapter.fn(str(folder), candidate.prompts, eval_batch, cache_dir).success
    return decide_adapter(model_name, version, candidate, ref, champion_success, threshold)
