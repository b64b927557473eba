"""Tiny continuous-control env for tests and examples (after SB3's ``IdentityEnvBox``): the right action is the
observation itself, so a learner that works solves it in a few thousand steps.

    opentinker train opentinker.envs.identity:ContinuousIdentity --algo sac
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from opentinker.envs.base import BaseEnv


class ContinuousIdentity(BaseEnv):
    """Observation: a target x drawn uniformly from [-1, 1]^dim each step; action: a point of the same box; reward:
    ``-|a - x|^2`` (0 is perfect; a uniform random policy scores ``-2/3`` per dimension and step). Episodes are
    ``episode_steps`` long (truncated, never terminated), so the return of a perfect policy is 0."""

    def __init__(self, dim: int = 1, episode_steps: int = 32):
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (dim,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (dim,), np.float32)
        self.episode_steps = episode_steps

    def _draw(self) -> np.ndarray:
        self.target = self.np_random.uniform(-1.0, 1.0, self.observation_space.shape).astype(np.float32)
        return self.target.copy()

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.t = 0
        return self._draw(), {}

    def step(self, action):
        reward = -float(np.square(np.asarray(action, np.float32) - self.target).sum())
        self.t += 1
        return self._draw(), reward, False, self.t >= self.episode_steps, {}
