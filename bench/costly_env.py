"""A CPU-heavy env for scaling benches, in its own module so Ray workers can import (and unpickle) it by name."""

from __future__ import annotations

import time

import gymnasium as gym


class CostlyCartPole(gym.Wrapper):
    """CartPole-v1 whose every step also burns ``cost_ms`` of CPU (a stand-in for a physics-heavy simulator)."""

    def __init__(self, cost_ms: float = 0.5):
        super().__init__(gym.make("CartPole-v1"))
        self.cost_s = cost_ms / 1000.0

    def step(self, action):
        deadline = time.perf_counter() + self.cost_s
        while time.perf_counter() < deadline:
            pass
        return self.env.step(action)
