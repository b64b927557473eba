"""A small env whose best policy is a mixed strategy, so greedy acting loses to sampling (tests of the served action).

``RockPaperScissorsEnv`` (``opentinker.envs.games:RockPaperScissorsEnv``): ``rounds`` rounds against an opponent
that plays what beats the player's most frequent move so far. The observation says nothing the opponent's move
depends on, so any deterministic policy plays one move and loses nearly every round (about ``-rounds``), while drawing
the moves at random keeps the opponent guessing (about 0): the optimum is the uniform mix, and a trained policy's
greedy action, the mode of a near-uniform distribution, is one fixed move.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from opentinker.envs.base import BaseEnv

BEATS = np.array([1, 2, 0])
"""``BEATS[m]``: the move that beats move ``m`` (0 rock, 1 paper, 2 scissors)."""


class RockPaperScissorsEnv(BaseEnv):
    """+1 for a won round, -1 for a lost one, 0 for a draw; the opponent's first move and its ties are random."""

    rounds = 20

    def __init__(self):
        self.observation_space = gym.spaces.Box(0.0, 1.0, (1,), np.float32)
        self.action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        self.counts = np.zeros(3, np.int64)
        return self._observe(), {}

    def _observe(self) -> np.ndarray:
        return np.ones(1, np.float32)

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        favourites = np.flatnonzero(self.counts == self.counts.max())
        opponent = BEATS[self.np_random.choice(favourites)]
        move = int(action)
        self.counts[move] += 1
        reward = 1.0 if opponent == BEATS[BEATS[move]] else (-1.0 if opponent == BEATS[move] else 0.0)
        return self._observe(), reward, False, int(self.counts.sum()) >= self.rounds, {}
