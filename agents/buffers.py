"""Replay buffer: fixed-size numpy ring of transitions, sampled with the trainer's Generator.

Observations keep the structure and dtypes of the observation space (SB3's ``DictReplayBuffer``): a dict or tuple of
rings for Dict/Tuple spaces, and uint8 images stay uint8 (an Atari buffer as float32 would be 4x the memory).
The ring is allocated once, at the first ``add``, at full capacity: untouched pages of ``np.zeros`` cost no memory
until written, so a 1M-transition buffer grows with the data while every write and sample stays a fancy index.
Float64 observations (MuJoCo's) are kept as the float32 the networks read.
"""

from __future__ import annotations

import numpy as np

from opentinker.envs.observations import Obs, index_obs, map_obs, obs_leaves
from opentinker.envs.rollout import Rollout

_FIELDS = ("obs", "next_obs", "actions", "rewards", "terminated")


def _stored(dtype: np.dtype) -> np.dtype:
    """The dtype a ring keeps: float64 as float32, the rest as it comes."""
    return np.dtype(np.float32) if dtype == np.float64 else dtype


class ReplayBuffer:
    def __init__(self, capacity: int):
        self.capacity, self.pos, self.size = capacity, 0, 0
        self.data: dict[str, Obs] = {}

    def add(self, obs: Obs, next_obs: Obs, actions: np.ndarray, rewards: np.ndarray, terminated: np.ndarray) -> None:
        """Append a batch of transitions (first axis), overwriting the oldest when full."""
        batch = dict(zip(_FIELDS, (obs, next_obs, actions, rewards, terminated)))
        rows = len(rewards)
        if not self.data:
            self.data = {k: map_obs(self._ring, v) for k, v in batch.items()}
        idx = (self.pos + np.arange(rows)) % self.capacity
        for key, value in batch.items():
            for ring, rows_in in zip(obs_leaves(self.data[key]), obs_leaves(value)):
                ring[idx] = rows_in
        self.pos = int((self.pos + rows) % self.capacity)
        self.size = int(min(self.size + rows, self.capacity))

    def add_rollout(self, rollout: Rollout) -> None:
        """Append a rollout's real transitions. The observation after step t is ``obs[t + 1]`` (the final observation
        at an episode's end), so truncated episodes bootstrap from it; only ``terminated`` stops the bootstrap."""
        next_obs = map_obs(lambda obs, last: np.concatenate([obs[1:], last[None]]), rollout.obs, rollout.last_obs)
        keep = rollout.valid
        self.add(
            index_obs(rollout.obs, keep),
            index_obs(next_obs, keep),
            rollout.actions[keep],
            rollout.rewards[keep],
            rollout.terminated[keep].astype(np.float32),
        )

    def _ring(self, rows: np.ndarray) -> np.ndarray:
        return np.zeros((self.capacity, *rows.shape[1:]), _stored(rows.dtype))

    def sample(self, shape: int | tuple[int, ...], rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Transitions drawn uniformly with replacement, each field shaped ``(*shape, ...)``."""
        idx = rng.integers(0, self.size, size=shape)
        return {k: map_obs(lambda ring: ring[idx], v) for k, v in self.data.items()}

    def __len__(self) -> int:
        return self.size

    def state_dict(self) -> dict:
        data = {k: map_obs(lambda ring: ring[: self.size].copy(), v) for k, v in self.data.items()}
        return {"pos": self.pos, "size": self.size, "data": data}

    def load_state_dict(self, state: dict) -> None:
        self.pos, self.size, self.data = state["pos"], state["size"], {}
        for key, value in state["data"].items():
            self.data[key] = map_obs(self._ring, value)
            for ring, saved in zip(obs_leaves(self.data[key]), obs_leaves(value)):
                ring[: self.size] = saved
