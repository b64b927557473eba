"""Observation batches as trees: an array, or a dict / tuple of arrays (gymnasium's Dict and Tuple spaces).

Structured observations stay structured from the env to the learner (as SB3's Dict buffers keep them): each leaf keeps
its own dtype and shape, so images stay uint8 in rollouts and replay buffers. These helpers apply one array operation
to every leaf; they work on numpy arrays and torch tensors alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

Obs = Any
"""An array (numpy or torch), or a dict / tuple of arrays."""


def map_obs(fn: Callable[..., Any], obs: Obs, *others: Obs) -> Obs:
    """``fn`` applied leaf by leaf to ``obs`` (and the matching leaves of ``others``), keeping the structure."""
    if isinstance(obs, dict):
        return {key: map_obs(fn, value, *(o[key] for o in others)) for key, value in obs.items()}
    if isinstance(obs, tuple):
        return tuple(map_obs(fn, value, *(o[i] for o in others)) for i, value in enumerate(obs))
    return fn(obs, *others)


def obs_leaves(obs: Obs) -> list[Any]:
    """The arrays of ``obs`` in structure order."""
    if isinstance(obs, dict):
        return [leaf for value in obs.values() for leaf in obs_leaves(value)]
    if isinstance(obs, tuple):
        return [leaf for value in obs for leaf in obs_leaves(value)]
    return [obs]


def batch_len(obs: Obs) -> int:
    """Rows of a batch (the first axis of its leaves)."""
    return len(obs_leaves(obs)[0])


def index_obs(obs: Obs, index: Any) -> Obs:
    """``obs[index]`` on every leaf (row selection, boolean masks, time slices)."""
    if isinstance(obs, np.ndarray):
        return obs[index]
    return map_obs(lambda leaf: leaf[index], obs)


def concat_obs(parts: Sequence[Obs], axis: int = 0) -> Obs:
    """Join batches leaf by leaf along ``axis``."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts, axis=axis)
    return map_obs(lambda *leaves: np.concatenate(leaves, axis=axis), parts[0], *parts[1:])


def stack_obs(items: Sequence[Obs]) -> Obs:
    """Single observations -> one batch (a new first axis on every leaf)."""
    return map_obs(lambda *leaves: np.stack([np.asarray(leaf) for leaf in leaves]), items[0], *items[1:])


def obs_nbytes(obs: Obs) -> int:
    return sum(leaf.nbytes for leaf in obs_leaves(obs))


def empty_steps(obs: Obs, n_steps: int) -> Obs:
    """An uninitialised ``(n_steps, *leaf.shape)`` buffer for each leaf, same dtypes (rollout storage)."""
    return map_obs(lambda leaf: np.empty((n_steps, *leaf.shape), dtype=leaf.dtype), obs)


def write_step(buffer: Obs, t: int, obs: Obs) -> None:
    """``buffer[t] = obs`` leaf by leaf."""
    if isinstance(buffer, np.ndarray):
        buffer[t] = obs
        return
    for target, value in zip(obs_leaves(buffer), obs_leaves(obs)):
        target[t] = value


def to_jsonable(obs: Obs) -> Any:
    """Nested lists (dicts for Dict observations), for a JSON request body."""
    if isinstance(obs, dict):
        return {key: to_jsonable(value) for key, value in obs.items()}
    if isinstance(obs, (tuple, list)) and not isinstance(obs, np.ndarray):
        return [to_jsonable(value) for value in obs]
    return np.asarray(obs).tolist()
