"""A training run's RL-core side, from its typed config: the env copies, the trainer (or the one in the run's last
checkpoint), and the loop with checkpoints. The pipeline's training stage runs these in its own process or in a
child process (``tasks/training_process.py``); the RL core never knows which."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opentinker.agents.config import TrainerConfig

Callback = Callable[[dict[str, float], int], "bool | None"]


def env_copies(
    env_id: str,
    seed: int,
    config: TrainerConfig,
    ray_options: dict[str, Any] | None = None,
    validate: bool = True,
) -> Any:
    """The env copies the config describes (its ``num_envs``, ``workers``, ``backend``, ``state_diff``)."""
    from opentinker.envs import RemoteEnv

    return RemoteEnv(
        env_id,
        parallel=config.num_envs,
        workers=config.workers,
        backend=config.backend,
        state_diff=config.state_diff,
        seed=seed,
        ray_options=ray_options,
        validate=validate,
    )


def build_trainer(
    env: Any, algorithm: str, config: TrainerConfig, seed: int, root: Path, device: str, resume: bool
) -> Any:
    """The RL-core trainer of ``algorithm`` built from its config; with ``resume`` the one in the run's last
    checkpoint."""
    from opentinker.agents import trainer_class
    from opentinker.agents.checkpoint import CHECKPOINT_NAME

    trainer_cls = trainer_class(algorithm)
    checkpoint = root / "checkpoints" / CHECKPOINT_NAME
    if resume and checkpoint.exists():
        return trainer_cls.load(checkpoint, env=env, device=device)
    (root / "history.jsonl").unlink(missing_ok=True)  # a fresh start begins a fresh curve
    return trainer_cls(env, policy="MLP", seed=seed, device=device, config=config)


def run_loop(trainer: Any, steps: int, root: Path, checkpoint_every: int | None, callback: Callback) -> float:
    """The RL core's ``train`` to ``steps`` with checkpoints under ``root/checkpoints``; its seconds."""
    checkpoints = root / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    trainer.train(steps, callback=callback, checkpoint_dir=checkpoints, checkpoint_every=checkpoint_every)
    return time.perf_counter() - started
