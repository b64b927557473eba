"""Multi-agent stages: train an ``AgentGroup`` (one task, checkpointed, metrics per kind to MLflow) and
evaluate it from its checkpoint. Registration reuses ``tasks.register.register_model`` once per kind."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from opentinker.agents.evaluation import EvalResult
from opentinker.tasks.spec import RunSpec
from opentinker.tasks.train import spec_dir
from opentinker.tracking.runs import MetricsLogger, configure_mlflow


class GroupTrainOutcome(BaseModel):
    """Where a group's checkpoint and per-kind exports are, how far it got."""

    run_id: str
    checkpoint_path: str = Field(description="One file: every kind's trainer checkpoint + env state + counters.")
    export_dirs: dict[str, str] = Field(description="Kind -> numpy-only export (policy.json + weights.npz).")
    history_path: str
    start_step: int
    global_step: int
    agent_steps: int
    train_seconds: float


@task(cache_policy=NO_CACHE)
def train_group(run_id: str, spec: RunSpec) -> GroupTrainOutcome:
    """Train every kind of ``spec``'s group until ``spec.steps`` env steps; resume from ``checkpoints/checkpoint.pt``
    when asked (a resumed run may change where the env copies run: ``backend``, ``workers``)."""
    from opentinker.agents.checkpoint import CHECKPOINT_NAME

    root = spec_dir(spec)
    checkpoint = root / "checkpoints" / CHECKPOINT_NAME
    configure_mlflow()
    if not (spec.resume and checkpoint.exists()):
        (root / "history.jsonl").unlink(missing_ok=True)
    trainer = group_trainer(spec, checkpoint if spec.resume else None)
    try:
        start_step = trainer.global_step
        logger = MetricsLogger.with_progress(run_id, spec.steps)
        started = time.perf_counter()
        trainer.train(
            spec.steps, callback=logger, checkpoint_dir=checkpoint.parent, checkpoint_every=spec.checkpoint_every
        )
        train_seconds = time.perf_counter() - started
        logger.flush()
        exports = trainer.export(root / "export", metadata={"env_id": spec.env_id, "run_id": run_id})
        return GroupTrainOutcome(
            run_id=run_id,
            checkpoint_path=str(checkpoint),
            export_dirs={k: str(v) for k, v in exports.items()},
            history_path=str(logger.save_history(root / "history.jsonl")),
            start_step=start_step,
            global_step=trainer.global_step,
            agent_steps=trainer.agent_steps,
            train_seconds=train_seconds,
        )
    finally:
        trainer.close()


def group_trainer(spec: RunSpec, checkpoint: Path | None) -> Any:
    """``spec``'s group, resumed from ``checkpoint`` when it exists (a resumed run may change where the env copies
    run: ``backend``, ``workers``), else new."""
    from opentinker.agents.multiagent import GroupTrainer

    group = spec.engine
    if checkpoint is not None and checkpoint.exists():
        return GroupTrainer.load(checkpoint, backend=group.backend, workers=group.workers)
    return group.config().build(
        spec.env_id,
        num_envs=group.num_envs,
        n_steps=group.n_steps,
        seed=spec.seed,
        backend=group.backend,
        workers=group.workers,
        **group.env_kwargs,
    )


@task(cache_policy=NO_CACHE)
def evaluate_group(checkpoint_path: str, episodes: int = 10, seed: int = 10_000) -> dict[str, EvalResult]:
    """Every kind acting deterministically, one episode per fresh env copy, from the saved group."""
    from opentinker.agents.multiagent import GroupTrainer

    trainer = GroupTrainer.load(checkpoint_path, device="cpu", backend="local")  # evaluation runs in-process
    try:
        return trainer.evaluate(episodes, seed)
    finally:
        trainer.close()
