"""Replay buffer: fixed-size numpy ring of transitions, sampled with the trainer's Generator.

The ring is allocated once, at the first ``add``, at full capacity: untouched pages of ``np.zeros`` cost no memory
until written, so a 1M-transition buffer grows with the data while every write and sample stays a fancy index."""

from __future__ import annotations

import numpy as np

_FIELDS = ("obs", "next_obs", "actions", "rewards", "terminated")


def _stored(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float32) if dtype == np.float64 else dtype


class ReplayBuffer:
    def __init__(self, capacity: int):
        self.capacity, self.pos, self.size = capacity, 0, 0
        self.data: dict[str, np.ndarray] = {}

    def add(
        self, obs: np.ndarray, next_obs: np.ndarray, actions: np.ndarray, rewards: np.ndarray, terminated: np.ndarray
    ) -> None:
        """Append a batch of transitions (first axis), overwriting the oldest when full."""
        batch = dict(zip(_FIELDS, (obs, next_obs, actions, rewards, terminated)))
        if not self.data:  # float64 observations (MuJoCo's) are kept as the float32 the networks read
            self.data = {k: np.zeros((self.capacity, *v.shape[1:]), _stored(v.dtype)) for k, v in batch.items()}
        idx = (self.pos + np.arange(len(obs))) % self.capacity
        for key, value in batch.items():
            self.data[key][idx] = value
        self.pos = int((self.pos + len(obs)) % self.capacity)
        self.size = int(min(self.size + len(obs), self.capacity))

    def sample(self, shape: int | tuple[int, ...], rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Transitions drawn uniformly with replacement, each field shaped ``(*shape, ...)``."""
        idx = rng.integers(0, self.size, size=shape)
        return {k: v[idx] for k, v in self.data.items()}

    def __len__(self) -> int:
        return self.size

    def state_dict(self) -> dict:
        return {"pos": self.pos, "size": self.size, "data": {k: v[: self.size].copy() for k, v in self.data.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.pos, self.size, self.data = state["pos"], state["size"], {}
        for key, value in state["data"].items():
            self.data[key] = np.zeros((self.capacity, *value.shape[1:]), value.dtype)
            self.data[key][: self.size] = value
