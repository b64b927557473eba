"""Behaviour cloning: supervised training of a policy's actor head on an offline dataset of transitions.

A dataset is a ``.npz`` file or a mapping of arrays with at least ``obs`` and ``actions`` (optional ``rewards``,
``terminated``, ``truncated``, ``next_obs`` are validated but not used by BC). ``load_transitions`` checks it against
the policy's spaces and names the offending field; ``behaviour_cloning`` runs a few epochs of cross-entropy
(Discrete actions) or mean-squared error / Gaussian NLL (Box actions) on the actor head only.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from opentinker.agents.policies import ActorCritic
from opentinker.infra.checks import check_field, check_ints

REQUIRED_FIELDS = ("obs", "actions")
OPTIONAL_FIELDS = ("rewards", "terminated", "truncated", "next_obs")
BOX_LOSSES = ("mse", "nll")


class DatasetError(ValueError):
    """An offline dataset is missing a field or does not fit the policy's spaces; the message names the field."""


@dataclass
class BCConfig:
    """Hyper-parameters of one behaviour-cloning update."""

    epochs: int = 5
    """Passes over the dataset per update."""
    batch_size: int = 64
    """Transitions per gradient step."""
    learning_rate: float = 1e-3
    """Adam learning rate (a fresh optimiser per update: the weights it starts from change between calls)."""
    box_loss: str = "mse"
    """Box actions: 'mse' on the Gaussian mean, or 'nll' (Gaussian negative log-likelihood, also fits log_std)."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip."""
    torch_threads: int | None = 1
    """Torch intra-op threads during the update (restored after); small MLPs are overhead-bound."""

    def __post_init__(self) -> None:
        check_ints(self, ("epochs", "batch_size"))
        check_field("learning_rate", self.learning_rate > 0, "> 0", self.learning_rate)
        check_field("box_loss", self.box_loss in BOX_LOSSES, f"one of {BOX_LOSSES}", self.box_loss)


@dataclass
class Transitions:
    """A validated dataset: ``obs`` (N, *obs_shape) float32, ``actions`` (N,) int64 or (N, action_dim) float32."""

    obs: np.ndarray
    actions: np.ndarray

    def __len__(self) -> int:
        return len(self.obs)


@dataclass
class BCStats:
    """What one update did: the weight of this dataset in an average is ``num_samples``."""

    num_samples: int
    epochs: float
    """Passes completed (fractional when the deadline stopped the update early)."""
    loss: float
    """Mean supervised loss over the last epoch."""
    seconds: float


def read_arrays(source: str | os.PathLike | Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` path or of a mapping, with unknown and missing fields rejected by name."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.suffix != ".npz":
            raise DatasetError(f"dataset {str(path)!r}: expected an .npz file")
        if not path.is_file():
            raise DatasetError(f"dataset {str(path)!r}: no such file")
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    elif isinstance(source, Mapping):
        arrays = {str(key): np.asarray(value) for key, value in source.items()}
    else:
        raise DatasetError(f"dataset must be an .npz path or a mapping of arrays, got {type(source).__name__}")
    unknown = sorted(set(arrays) - set(REQUIRED_FIELDS) - set(OPTIONAL_FIELDS))
    if unknown:
        raise DatasetError(
            f"dataset: unknown field(s) {unknown}; expected {REQUIRED_FIELDS} and optionally {OPTIONAL_FIELDS}"
        )
    missing = [key for key in REQUIRED_FIELDS if key not in arrays]
    if missing:
        raise DatasetError(f"dataset: missing field(s) {missing}; a transition dataset needs {REQUIRED_FIELDS}")
    n = len(arrays["obs"]) if arrays["obs"].ndim else 0
    if n == 0:
        raise DatasetError("dataset: 'obs' holds no transitions")
    for key, value in arrays.items():
        if value.ndim == 0 or len(value) != n:
            raise DatasetError(f"dataset: {key!r} has {len(value) if value.ndim else 0} rows but 'obs' has {n}")
        if not (np.issubdtype(value.dtype, np.number) or value.dtype == np.bool_):
            raise DatasetError(f"dataset: {key!r} must be numeric, got dtype {value.dtype}")
        if np.issubdtype(value.dtype, np.floating) and not np.all(np.isfinite(value)):
            bad = int(np.argwhere((~np.isfinite(value.reshape(n, -1))).any(axis=1))[0, 0])
            raise DatasetError(f"dataset: {key!r} has a NaN or infinite value (first at row {bad})")
    for key in ("rewards", "terminated", "truncated"):
        if key in arrays and arrays[key].ndim != 1:
            raise DatasetError(
                f"dataset: {key!r} must be 1-D (one value per transition), got shape {arrays[key].shape}"
            )
    return arrays


def _check_obs(obs: np.ndarray, space: gym.Space, key: str = "obs") -> np.ndarray:
    if isinstance(space, gym.spaces.Discrete):
        if obs.ndim != 1 or not np.issubdtype(obs.dtype, np.integer):
            raise DatasetError(
                f"dataset: {key!r} must be 1-D integers for observation space {space}, got {obs.dtype} {obs.shape}"
            )
        if obs.min() < space.start or obs.max() >= space.start + space.n:
            raise DatasetError(
                f"dataset: {key!r} values must lie in [{space.start}, {space.start + space.n}) for {space}"
            )
        return obs.astype(np.int64) - int(space.start)
    if not isinstance(space, gym.spaces.Box):
        raise DatasetError(f"dataset: observation space {space} is not supported (expected Box or Discrete)")
    if obs.shape[1:] != space.shape:
        raise DatasetError(
            f"dataset: {key!r} rows have shape {obs.shape[1:]}, the observation space expects {space.shape}"
        )
    outside = (obs < space.low) | (obs > space.high)
    if outside.any():
        row = int(np.argwhere(outside.reshape(len(obs), -1).any(axis=1))[0, 0])
        raise DatasetError(f"dataset: {key!r} row {row} lies outside the observation space bounds {space}")
    return obs.astype(np.float32)


def _check_actions(actions: np.ndarray, space: gym.Space) -> np.ndarray:
    if isinstance(space, gym.spaces.Discrete):
        flat = actions.reshape(len(actions), -1)
        if flat.shape[1] != 1:
            raise DatasetError(f"dataset: 'actions' must hold one discrete action per row, got shape {actions.shape}")
        flat = flat[:, 0]
        if not np.all(flat == np.round(flat)):
            raise DatasetError(f"dataset: 'actions' must be whole numbers for action space {space}")
        if flat.min() < space.start or flat.max() >= space.start + space.n:
            raise DatasetError(
                f"dataset: 'actions' out of range: values span [{flat.min()}, {flat.max()}], "
                f"action space {space} allows [{space.start}, {space.start + space.n - 1}]"
            )
        return flat.astype(np.int64) - int(space.start)
    if isinstance(space, gym.spaces.Box) and len(space.shape) == 1:
        dim = space.shape[0]
        if actions.ndim == 1 and dim == 1:
            actions = actions[:, None]
        if actions.shape[1:] != (dim,):
            raise DatasetError(
                f"dataset: 'actions' rows have shape {actions.shape[1:]}, the action space expects {(dim,)}"
            )
        low, high = space.low - 1e-6, space.high + 1e-6
        if np.any(actions < low) or np.any(actions > high):
            raise DatasetError(
                f"dataset: 'actions' out of range: values span [{actions.min():.4g}, {actions.max():.4g}], "
                f"action space {space} allows [{space.low.tolist()}, {space.high.tolist()}]"
            )
        return actions.astype(np.float32)
    raise DatasetError(f"dataset: action space {space} is not supported (expected Discrete or a 1-D Box)")


def load_transitions(
    source: str | os.PathLike | Mapping[str, Any], observation_space: gym.Space, action_space: gym.Space
) -> Transitions:
    """Read and validate a dataset against the policy's spaces; raise ``DatasetError`` naming the field."""
    arrays = read_arrays(source)
    obs = _check_obs(arrays["obs"], observation_space)
    if "next_obs" in arrays:
        _check_obs(arrays["next_obs"], observation_space, "next_obs")
    return Transitions(obs=obs, actions=_check_actions(arrays["actions"], action_space))


def _loss(policy: ActorCritic, obs: torch.Tensor, actions: torch.Tensor, box_loss: str) -> torch.Tensor:
    out = policy.actor(policy.preprocess(obs)).float()
    if policy.spec["kind"] == "categorical":
        return torch.nn.functional.cross_entropy(out, actions)
    if box_loss == "mse":
        return ((out - actions) ** 2).sum(-1).mean()
    log_std = policy.log_std.expand_as(out)
    return (0.5 * ((actions - out) / log_std.exp()) ** 2 + log_std + 0.5 * math.log(2 * math.pi)).sum(-1).mean()


def behaviour_cloning(
    policy: ActorCritic,
    data: Transitions,
    config: BCConfig,
    rng: np.random.Generator,
    deadline: float | None = None,
    anchor: Mapping[str, np.ndarray] | None = None,
    proximal_mu: float = 0.0,
) -> BCStats:
    """Fit the actor head of ``policy`` to ``data`` in place; the critic is left untouched.

    Stops after ``config.epochs`` or at ``deadline`` (``time.monotonic()``), whichever is first, after at least one
    gradient step. With ``proximal_mu > 0`` the loss adds (mu/2)·||w - anchor||² over the trained tensors (FedProx).
    """
    if policy.spec["kind"] not in ("categorical", "gaussian"):
        raise ValueError(
            f"behaviour cloning needs an actor with a categorical or Gaussian head, got {policy.spec['kind']!r}"
        )
    device = next(policy.parameters()).device
    named = [(f"actor.{name}", p) for name, p in policy.actor.named_parameters()]
    if policy.spec["kind"] == "gaussian" and config.box_loss == "nll":
        named.append(("log_std", policy.log_std))
    params = [p for _, p in named]
    anchors = (
        [torch.as_tensor(np.asarray(anchor[name]), device=device) for name, _ in named]
        if anchor and proximal_mu > 0
        else []
    )
    optimizer = torch.optim.Adam(params, lr=config.learning_rate)
    obs = torch.as_tensor(data.obs, device=device)
    actions = torch.as_tensor(data.actions, device=device)
    n, batch = len(data), min(config.batch_size, len(data))
    steps_per_epoch = math.ceil(n / batch)
    threads = torch.get_num_threads()
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    started, steps, epoch_losses = time.monotonic(), 0, []
    try:
        for _ in range(config.epochs):
            order, epoch_losses = torch.as_tensor(rng.permutation(n), device=device), []
            for start in range(0, n, batch):
                idx = order[start : start + batch]
                loss = _loss(policy, obs[idx], actions[idx], config.box_loss)
                epoch_losses.append(float(loss.detach()))
                if anchors:
                    loss = loss + 0.5 * proximal_mu * sum(((p - a) ** 2).sum() for p, a in zip(params, anchors))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
                optimizer.step()
                steps += 1
                if deadline is not None and time.monotonic() >= deadline:
                    break
            if deadline is not None and time.monotonic() >= deadline:
                break
    finally:
        torch.set_num_threads(threads)
    return BCStats(
        num_samples=n,
        epochs=steps / steps_per_epoch,
        loss=float(np.mean(epoch_losses)),
        seconds=time.monotonic() - started,
    )
