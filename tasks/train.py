"""The training stage: one Prefect task running the engine's whole loop on Ray rollout actors.

Why one task and not one per iteration: a Prefect task run costs tens of milliseconds of API
round-trips and state bookkeeping, while a CartPole PPO iteration is ~0.1–0.3 s; per-iteration
tasks would cost far more than the 15 % overhead budget. Per-iteration visibility comes from the
engine's callback instead (metrics to MLflow in batches, progress to the CLI); crash safety from
the engine's atomic checkpoints (``resume=True`` continues from the last one); worker death is
handled inside the iteration by Ray (actor restarts, rollouts reseeded by (seed, iteration, worker)).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from opentinker.tasks import progress
from opentinker.tasks.tracking import MetricsLogger, configure_mlflow
from opentinker.tasks.types import TrainOutcome

def run_dir(data_dir: Path, run_name: str) -> Path:
    """Checkpoints, export, history and reports of one named training run (the resume key)."""
    return data_dir / "runs" / run_name


@task(cache_policy=NO_CACHE)
def train_policy(
    run_id: str,
    env_id: str,
    steps: int,
    seed: int,
    directory: str,
    num_envs: int = 8,
    workers: int | None = None,
    ppo: dict[str, Any] | None = None,
    num_gpus: float = 0.0,
    resume: bool = False,
    checkpoint_every: int | None = None,
    rollout_num_cpus: float | None = None,
    rollout_num_gpus: float = 0.0,
) -> TrainOutcome:
    """Train PPO until ``steps`` global env steps with Ray rollouts; checkpoint, export, log every iteration.

    The engine rewrites ``checkpoints/checkpoint.pt`` atomically every ``checkpoint_every`` env steps and
    at the end; with ``resume`` training continues from it (a finished run just re-exports).
    The learner trains on the GPU Ray grants for ``num_gpus`` (``learner_device``); the Ray node ids of the
    rollout actors are logged as run tags, at the start and at the end (they differ when a node was replaced).
    """
    import mlflow

    from opentinker.envs import RemoteEnv
    from opentinker.infra.ray_runtime import failing_without_rollout_nodes, learner_device, rollout_actor_options

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    configure_mlflow()
    client = mlflow.MlflowClient()
    with learner_device(num_gpus) as device:  # first: a missing GPU fails before any actor starts
        options = rollout_actor_options(rollout_num_cpus, rollout_num_gpus)
        env = RemoteEnv(env_id, parallel=num_envs, workers=workers, backend="ray", seed=seed, ray_options=options)
        try:
            nodes = env.worker_node_ids()
            _write_json(root / "workers.json", {"pids": env.worker_pids(), "nodes": nodes})
            client.set_tag(run_id, "opentinker.rollout_nodes", ",".join(nodes))
            with failing_without_rollout_nodes(options, env.close):
                outcome = _train(env, run_id, env_id, steps, seed, root, ppo, device, resume, checkpoint_every)
            client.set_tag(run_id, "opentinker.rollout_nodes_final", ",".join(env.worker_node_ids()))
            return outcome
        finally:
            env.close()


def _train(env: Any, run_id: str, env_id: str, steps: int, seed: int, root: Path, ppo: dict[str, Any] | None,
           device: str, resume: bool, checkpoint_every: int | None) -> TrainOutcome:
    from opentinker.agents import PPOTrainer
    from opentinker.agents.checkpoint import CHECKPOINT_NAME
    from opentinker.agents.export import export_policy

    checkpoint_dir = root / "checkpoints"
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = checkpoint_dir / CHECKPOINT_NAME
    if resume and checkpoint.exists():
        trainer = PPOTrainer.load(checkpoint, env=env, device=device)
    else:
        trainer = PPOTrainer(env, policy="MLP", seed=seed, device=device, **(ppo or {}))
        (root / "history.jsonl").unlink(missing_ok=True)  # a fresh start begins a fresh curve
    start_step = int(trainer.global_step)
    logger = MetricsLogger(run_id, on_iteration=lambda step, row: progress.report(step, steps, row))
    started = time.perf_counter()
    trainer.train(steps, callback=logger, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every)
    train_seconds = time.perf_counter() - started
    logger.flush()
    get_run_logger().info("trained to env step %d in %.1f s (%d iterations)", trainer.global_step, train_seconds,
                          len(logger.history))
    export_dir = export_policy(trainer, root / "export", metadata={"env_id": env_id, "run_id": run_id})
    history = logger.save_history(root / "history.jsonl")
    return TrainOutcome(
        run_id=run_id,
        checkpoint_path=str(checkpoint),
        export_dir=str(export_dir),
        history_path=str(history),
        start_step=start_step,
        global_step=int(trainer.global_step),
        iterations=len(logger.history),
        train_seconds=train_seconds,
        worker_pids=env.worker_pids(),
    )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomic: ops tools (and the kill-a-worker test) read it while training runs."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
