"""Small envs for the user-env benchmark (``bench/userenvs.py``): one per kind of observation (vector, Dict, small
and larger uint8 image) and of action (Discrete, MultiDiscrete, MultiBinary, Box), each a short task that needs
several steps of credit assignment (not an identity mapping), so a 20k-step run can learn it and a random policy
cannot.

Each is importable as ``opentinker.envs.bench_envs:ClassName`` (what a user's own env looks like to the CLI: no
registry spec, so no preset). ``return_range`` is (about a random policy's return, the best return): the bench
counts a case as behind when our median return is below SB3's by more than 10 % of that range.

- ``GridReachEnv``: vector observation, ``Discrete(5)``: walk to the goal on a 6 x 6 grid (reward at the goal only).
- ``DictReachEnv``: ``Dict`` observation (a position in raw grid units and the goal as ``MultiDiscrete``),
  ``Discrete(5)``, 8 x 8 grid: the parts have different scales and encodings.
- ``CatchEnv``: a 16 x 16 uint8 image (``LargeCatchEnv``: the same game drawn 64 x 64), ``Discrete(3)``: move the
  paddle under a falling ball; +1 or -1 when it lands, 15 steps later.
- ``KeyDoorEnv``: ``MultiDiscrete([5, 2])`` (a move and "use"): pick up the key, then open the door.
- ``ThrusterEnv``: ``MultiBinary(4)`` thrusters push a point mass (with inertia) to a goal.
- ``PointReachEnv``: ``Box(2)`` velocity actions steer a point to a goal.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from opentinker.envs.base import BaseEnv

MOVES = np.array([[0, 0], [-1, 0], [1, 0], [0, -1], [0, 1]], np.int64)
"""Grid moves: stay, up, down, left, right."""


class _GridEnv(BaseEnv):
    """A grid walk with a goal: -``step_cost`` per step, +1 and the end on the goal, truncated at ``max_steps``."""

    size, max_steps, step_cost = 6, 20, 0.05

    def _new_episode(self) -> None:
        cells = self.np_random.choice(self.size * self.size, 2, replace=False)
        self.agent, self.goal = np.array(divmod(cells[0], self.size)), np.array(divmod(cells[1], self.size))

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        self.steps = 0
        self._new_episode()
        return self._observe(), {}

    def _move(self, move: int) -> None:
        self.agent = np.clip(self.agent + MOVES[int(move)], 0, self.size - 1)

    def _finish_step(self, reached: bool) -> tuple[Any, float, bool, bool, dict]:
        self.steps += 1
        reward = (1.0 if reached else 0.0) - self.step_cost
        return self._observe(), reward, reached, self.steps >= self.max_steps, {}

    def _observe(self) -> Any:
        raise NotImplementedError


class GridReachEnv(_GridEnv):
    """Observation: agent and goal cells scaled to [0, 1] (4 floats); reward 1 at the goal, -0.05 a step."""

    return_range = (-0.6, 0.85)

    def __init__(self):
        self.observation_space = gym.spaces.Box(0.0, 1.0, (4,), np.float32)
        self.action_space = gym.spaces.Discrete(5)

    def _observe(self) -> np.ndarray:
        return (np.concatenate([self.agent, self.goal]) / (self.size - 1)).astype(np.float32)

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        self._move(action)
        return self._finish_step(bool(np.all(self.agent == self.goal)))


class DictReachEnv(_GridEnv):
    """``{"position": Box(0, 7) floats in grid units, "goal": MultiDiscrete([8, 8])}`` on an 8 x 8 grid, 30 steps."""

    size, max_steps, step_cost = 8, 30, 0.03
    return_range = (-0.7, 0.85)

    def __init__(self):
        self.observation_space = gym.spaces.Dict(
            {
                "position": gym.spaces.Box(0.0, self.size - 1.0, (2,), np.float32),
                "goal": gym.spaces.MultiDiscrete([self.size, self.size]),
            }
        )
        self.action_space = gym.spaces.Discrete(5)

    def _observe(self) -> dict[str, np.ndarray]:
        return {"position": self.agent.astype(np.float32), "goal": self.goal.astype(np.int64)}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        self._move(action)
        return self._finish_step(bool(np.all(self.agent == self.goal)))


class KeyDoorEnv(_GridEnv):
    """A 4 x 4 grid with a key and a door; action ``[move, use]``: "use" on the key picks it up, on the door with
    the key opens it (+1, the end). Observation: agent, key and door cells in [0, 1] and whether the key is held."""

    size, max_steps, step_cost = 4, 20, 0.01
    return_range = (-0.15, 0.95)

    def __init__(self):
        self.observation_space = gym.spaces.Box(0.0, 1.0, (7,), np.float32)
        self.action_space = gym.spaces.MultiDiscrete([5, 2])

    def _new_episode(self) -> None:
        cells = self.np_random.choice(self.size * self.size, 3, replace=False)
        self.agent, self.key, self.goal = (np.array(divmod(c, self.size)) for c in cells)
        self.has_key = False

    def _observe(self) -> np.ndarray:
        cells = np.concatenate([self.agent, self.key, self.goal]) / (self.size - 1)
        return np.append(cells, float(self.has_key)).astype(np.float32)

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        move, use = (int(a) for a in np.asarray(action).reshape(-1))
        self._move(move)
        opened = False
        if use:
            if not self.has_key and np.all(self.agent == self.key):
                self.has_key = True
            elif self.has_key and np.all(self.agent == self.goal):
                opened = True
        return self._finish_step(opened)


class CatchEnv(BaseEnv):
    """A ball falls one row a step from a random column of a 16 x 16 board; a 3-cell paddle on the bottom row moves
    left, stays or moves right. +1 if the ball lands on the paddle, -1 if not (15 steps, one ball). The board is drawn
    ``scale`` pixels per cell as a one-channel uint8 image (ball and paddle 255)."""

    cells = 16
    return_range = (-0.75, 1.0)

    def __init__(self, scale: int = 1):
        self.scale = scale
        side = self.cells * scale
        self.observation_space = gym.spaces.Box(0, 255, (side, side, 1), np.uint8)
        self.action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        self.ball_row, self.ball_col = 0, int(self.np_random.integers(self.cells))
        self.paddle = int(self.np_random.integers(1, self.cells - 1))
        return self._observe(), {}

    def _observe(self) -> np.ndarray:
        board = np.zeros((self.cells, self.cells), np.uint8)
        board[self.ball_row, self.ball_col] = 255
        board[-1, self.paddle - 1 : self.paddle + 2] = 255
        if self.scale > 1:
            board = board.repeat(self.scale, 0).repeat(self.scale, 1)
        return board[..., None]

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        self.paddle = int(np.clip(self.paddle + int(action) - 1, 1, self.cells - 2))
        self.ball_row += 1
        landed = self.ball_row == self.cells - 1
        reward = (1.0 if abs(self.ball_col - self.paddle) <= 1 else -1.0) if landed else 0.0
        return self._observe(), reward, landed, False, {}


class LargeCatchEnv(CatchEnv):
    """``CatchEnv`` drawn 64 x 64 (4 pixels a cell): the larger-image case (SB3's ``CnnPolicy`` takes it)."""

    def __init__(self):
        super().__init__(scale=4)


class ThrusterEnv(BaseEnv):
    """A point mass in [-1, 1]^2 with four on/off thrusters (+x, -x, +y, -y; ``MultiBinary(4)``), velocity damped by
    0.8 a step. Reward: the step's progress towards the goal, +1 on reaching it (within 0.15; the end); 40 steps.
    Observation: position, velocity (x5) and goal."""

    thrust, damping, radius, max_steps = 0.03, 0.8, 0.15, 40
    return_range = (0.1, 1.75)

    def __init__(self):
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (6,), np.float32)
        self.action_space = gym.spaces.MultiBinary(4)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        self.pos = self.np_random.uniform(-0.9, 0.9, 2)
        self.goal = self.np_random.uniform(-0.9, 0.9, 2)
        self.vel, self.steps = np.zeros(2), 0
        return self._observe(), {}

    def _observe(self) -> np.ndarray:
        return np.clip(np.concatenate([self.pos, 5.0 * self.vel, self.goal]), -1.0, 1.0).astype(np.float32)

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        bits = np.asarray(action, np.float64).reshape(-1)
        before = np.linalg.norm(self.goal - self.pos)
        self.vel = self.damping * self.vel + self.thrust * np.array([bits[0] - bits[1], bits[2] - bits[3]])
        self.pos = np.clip(self.pos + self.vel, -1.0, 1.0)
        self.steps += 1
        after = np.linalg.norm(self.goal - self.pos)
        reached = bool(after < self.radius)
        reward = (before - after) + (1.0 if reached else 0.0)
        return self._observe(), float(reward), reached, self.steps >= self.max_steps, {}


class PointReachEnv(BaseEnv):
    """A point in [-1, 1]^2 moved by ``0.1 * action`` (``Box(-1, 1, (2,))``) towards a goal. Reward: the step's
    progress, +1 on reaching it (within 0.1; the end); 30 steps. Observation: position and goal."""

    speed, radius, max_steps = 0.1, 0.1, 30
    return_range = (0.0, 1.75)

    def __init__(self):
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        self.pos = self.np_random.uniform(-0.9, 0.9, 2)
        self.goal = self.np_random.uniform(-0.9, 0.9, 2)
        self.steps = 0
        return self._observe(), {}

    def _observe(self) -> np.ndarray:
        return np.concatenate([self.pos, self.goal]).astype(np.float32)

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        move = np.clip(np.asarray(action, np.float64).reshape(-1), -1.0, 1.0)
        before = np.linalg.norm(self.goal - self.pos)
        self.pos = np.clip(self.pos + self.speed * move, -1.0, 1.0)
        self.steps += 1
        after = np.linalg.norm(self.goal - self.pos)
        reached = bool(after < self.radius)
        reward = before - after + (1.0 if reached else 0.0)
        return self._observe(), float(reward), reached, self.steps >= self.max_steps, {}


BENCH_ENVS = {
    "vector-discrete": GridReachEnv,
    "dict-discrete": DictReachEnv,
    "image16-discrete": CatchEnv,
    "image64-discrete": LargeCatchEnv,
    "vector-multidiscrete": KeyDoorEnv,
    "vector-multibinary": ThrusterEnv,
    "vector-box": PointReachEnv,
}
"""Case name (observation kind - action kind) -> env class."""
