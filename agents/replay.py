"""What the replay learners (DQN, SAC, TD3) share: the rollouts' real transitions kept in a replay buffer, and the
gradient steps they owe (one per ``train_frequency`` env steps once ``learning_starts`` have passed), their batches
drawn together after each rollout as SB3 does, so the per-step work is the algorithm's update alone."""

from __future__ import annotations

from typing import Any

import torch

from opentinker.agents.buffers import ReplayBuffer
from opentinker.agents.trainer import Trainer
from opentinker.envs.observations import map_obs
from opentinker.envs.rollout import Rollout


class ReplayTrainer(Trainer):
    """Subclasses call ``_build_replay()`` in ``_build`` and, per rollout, ``store`` then ``replay_batches``."""

    def _build_replay(self) -> None:
        self.buffer = ReplayBuffer(self.config.buffer_size)
        self.pending_updates = 0.0  # a fraction of a gradient step owed (train_frequency not dividing a rollout)

    @property
    def warming_up(self) -> bool:
        return self.global_step < self.config.learning_starts

    def store(self, rollout: Rollout) -> None:
        """Count the rollout's env steps and keep its real transitions (``ReplayBuffer.add_rollout``)."""
        self.global_step += rollout.num_steps
        self.buffer.add_rollout(rollout)

    def replay_batches(self, num_env_steps: int) -> dict[str, Any] | None:
        """The gradient steps due for ``num_env_steps`` new env steps (one per ``train_frequency``), their batches
        drawn at once, shaped ``(steps, rows, ...)`` (observations as trees of the space's structure): this
        learner's rows of each batch (all of them when it is alone). None while warming up or when no step is due."""
        c = self.config
        if self.warming_up:
            return None
        self.pending_updates += num_env_steps / c.train_frequency
        steps = int(self.pending_updates)
        self.pending_updates -= steps
        if steps == 0:
            return None
        part = self.sync.shard(c.batch_size)
        to_device = lambda rows: torch.as_tensor(rows[:, part], device=self.device)  # noqa: E731
        return {k: map_obs(to_device, v) for k, v in self.buffer.sample((steps, c.batch_size), self.rng).items()}

    def _extra_state(self) -> dict[str, Any]:
        return {"buffer": self.buffer.state_dict(), "pending_updates": self.pending_updates}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state["buffer"])
        self.pending_updates = state["pending_updates"]
