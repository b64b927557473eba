"""Small deterministic envs for each kind of space, after SB3's identity envs: every step shows a random target and
rewards the action that matches it, so a policy that reads its observations right learns in seconds.

Each is importable as ``opentinker.envs.identity:ClassName`` (the CLI and ``train_flow`` take that form). An episode is
``episode_length`` steps; the reward of a step is the fraction of the target matched (1.0 when all of it is), so the
best return is ``episode_length`` and a random policy's is well below it.

- ``DictIdentityEnv``: a ``Dict`` of a uint8 image and a vector; the right action needs both (SB3's
  ``MultiInputPolicy`` case).
- ``MultiDiscreteIdentityEnv``: ``MultiDiscrete`` actions (and observations: the target itself).
- ``MultiBinaryIdentityEnv``: ``MultiBinary`` actions (and observations).
- ``ImageIdentityEnv``: a small uint8 image (channel-last by default) showing a bright patch in one quadrant; the
  action names the quadrant.
- ``BoxIdentityEnv``: continuous control (SB3's ``IdentityEnvBox``): the action should be the observed point of
  [-1, 1]^dim; the reward is 1 minus the mean distance over 2, so a near miss still earns most of it (SAC, TD3).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from opentinker.envs.base import BaseEnv


class IdentityEnv(BaseEnv):
    """The loop shared by the identity envs: subclasses draw a target, render it and score an action against it."""

    def __init__(self, episode_length: int = 16):
        self.episode_length = episode_length
        self._step, self._target = 0, None

    def _draw(self) -> Any:
        raise NotImplementedError

    def _observe(self, target: Any) -> Any:
        raise NotImplementedError

    def _score(self, action: Any, target: Any) -> float:
        return float(np.mean(np.asarray(action) == np.asarray(target)))

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        self._step, self._target = 0, self._draw()
        return self._observe(self._target), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        reward = self._score(action, self._target)
        self._step += 1
        self._target = self._draw()
        return self._observe(self._target), reward, self._step >= self.episode_length, False, {}


def _quadrant_image(rng: np.random.Generator, quadrant: int, side: int, channels: int) -> np.ndarray:
    """A dim noisy H x W x C image with a bright patch in ``quadrant`` (0 top-left, 1 top-right, 2 bottom-left, ...)."""
    image = rng.integers(0, 64, (side, side, channels), dtype=np.uint8)
    half, patch = side // 2, max(side // 4, 2)
    top = (quadrant // 2) * half + (half - patch) // 2
    left = (quadrant % 2) * half + (half - patch) // 2
    image[top : top + patch, left : left + patch] = 255
    return image


class ImageIdentityEnv(IdentityEnv):
    """``side`` x ``side`` uint8 images (channel-last, or channel-first with ``channels_first``); 4 actions."""

    def __init__(self, side: int = 16, channels: int = 3, channels_first: bool = False, episode_length: int = 16):
        super().__init__(episode_length)
        self.side, self.channels, self.channels_first = side, channels, channels_first
        shape = (channels, side, side) if channels_first else (side, side, channels)
        self.observation_space = gym.spaces.Box(0, 255, shape, np.uint8)
        self.action_space = gym.spaces.Discrete(4)

    def _draw(self) -> int:
        return int(self.np_random.integers(4))

    def _observe(self, target: int) -> np.ndarray:
        image = _quadrant_image(self.np_random, target, self.side, self.channels)
        return np.ascontiguousarray(image.transpose(2, 0, 1)) if self.channels_first else image


class DictIdentityEnv(IdentityEnv):
    """``{"image": 8x8x1 uint8, "vector": 2 floats}``; 4 actions: 2 x (patch in the top half) + (vector[0] > 0)."""

    def __init__(self, episode_length: int = 16):
        super().__init__(episode_length)
        self.observation_space = gym.spaces.Dict(
            {
                "image": gym.spaces.Box(0, 255, (8, 8, 1), np.uint8),
                "vector": gym.spaces.Box(-1.0, 1.0, (2,), np.float32),
            }
        )
        self.action_space = gym.spaces.Discrete(4)

    def _draw(self) -> int:
        return int(self.np_random.integers(4))

    def _observe(self, target: int) -> dict[str, np.ndarray]:
        top, positive = divmod(target, 2)
        image = _quadrant_image(self.np_random, 2 * (1 - top) + int(self.np_random.integers(2)), 8, 1)
        sign = 1.0 if positive else -1.0
        vector = np.array([sign * self.np_random.uniform(0.2, 1.0), self.np_random.uniform(-1.0, 1.0)], np.float32)
        return {"image": image, "vector": vector}


class MultiDiscreteIdentityEnv(IdentityEnv):
    """Observation = target = a ``MultiDiscrete(nvec)`` point; the action should repeat it."""

    def __init__(self, nvec: tuple[int, ...] = (3, 4, 2), episode_length: int = 16):
        super().__init__(episode_length)
        self.observation_space = gym.spaces.MultiDiscrete(list(nvec))
        self.action_space = gym.spaces.MultiDiscrete(list(nvec))

    def _draw(self) -> np.ndarray:
        return (self.np_random.random(len(self.action_space.nvec)) * self.action_space.nvec).astype(np.int64)

    def _observe(self, target: np.ndarray) -> np.ndarray:
        return target.copy()


class MultiBinaryIdentityEnv(IdentityEnv):
    """Observation = target = ``n`` bits; the action should repeat them."""

    def __init__(self, n: int = 4, episode_length: int = 16):
        super().__init__(episode_length)
        self.observation_space = gym.spaces.MultiBinary(n)
        self.action_space = gym.spaces.MultiBinary(n)

    def _draw(self) -> np.ndarray:
        return self.np_random.integers(0, 2, self.action_space.n, dtype=np.int8)

    def _observe(self, target: np.ndarray) -> np.ndarray:
        return target.copy()


class BoxIdentityEnv(IdentityEnv):
    """Observation = target = a point of [-1, 1]^dim; actions in the same box. An untrained actor answering 0 scores
    about 0.75 a step, a uniform random one about 2/3; a learned one close to 1."""

    def __init__(self, dim: int = 1, episode_length: int = 16):
        super().__init__(episode_length)
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (dim,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (dim,), np.float32)

    def _draw(self) -> np.ndarray:
        return self.np_random.uniform(-1.0, 1.0, self.action_space.shape).astype(np.float32)

    def _observe(self, target: np.ndarray) -> np.ndarray:
        return target.copy()

    def _score(self, action: Any, target: np.ndarray) -> float:
        return 1.0 - float(np.mean(np.abs(np.asarray(action, np.float32) - target))) / 2.0
