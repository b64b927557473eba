"""Export a trained policy as ``policy.json`` + ``weights.npz`` and load it back as a numpy-only policy.

The export needs neither torch nor the training code to run: serving, federated clients and MLflow pyfunc
models all load it with ``load_policy``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from opentinker.envs.numpy_policy import NumpyPolicy
from opentinker.infra.files import atomic_write

FORMAT_VERSION = 1
SPEC_FILE, WEIGHTS_FILE = "policy.json", "weights.npz"


def space_to_json(space: gym.Space) -> dict[str, Any]:
    if isinstance(space, gym.spaces.Discrete):
        return {"type": "Discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, gym.spaces.Box):
        return {
            "type": "Box",
            "low": space.low.tolist(),
            "high": space.high.tolist(),
            "shape": list(space.shape),
            "dtype": str(space.dtype),
        }
    raise ValueError(f"cannot export space {space}: only Box and Discrete are supported")


def space_from_json(data: dict[str, Any]) -> gym.Space:
    if data["type"] == "Discrete":
        return gym.spaces.Discrete(data["n"], start=data.get("start", 0))
    if data["type"] == "Box":
        dtype = np.dtype(data["dtype"])
        return gym.spaces.Box(np.array(data["low"], dtype), np.array(data["high"], dtype), tuple(data["shape"]), dtype)
    raise ValueError(f"unknown space type {data['type']!r} in policy.json")


class InferencePolicy:
    """A loaded export: numpy forward only; ``act`` is deterministic (greedy / mean action)."""

    def __init__(self, spec: dict[str, Any], weights: dict[str, np.ndarray]):
        self.spec = spec
        self.observation_space = space_from_json(spec["observation_space"])
        self.action_space = space_from_json(spec["action_space"])
        self._net = NumpyPolicy(spec["architecture"], weights)

    def _batch(self, obs_batch: Any) -> np.ndarray:
        obs = np.asarray(obs_batch, dtype=self.observation_space.dtype)
        shape = self.observation_space.shape
        if obs.shape[1:] != shape:
            raise ValueError(
                f"observation batch has shape {obs.shape}; expected (batch, {', '.join(map(str, shape))})"
                if shape
                else f"observation batch has shape {obs.shape}; expected (batch,)"
            )
        return obs

    def act(self, obs_batch: Any) -> np.ndarray:
        """Env-ready actions, one per row of ``obs_batch`` (shape (batch, *observation_space.shape)): continuous
        actions are clipped to the action space, and every action is checked to lie in it."""
        actions = self._net.act(self._batch(obs_batch), deterministic=True)
        self._check_actions(actions)
        return actions

    def _check_actions(self, actions: np.ndarray) -> None:
        """Vectorised ``action_space.contains`` over the batch (the serving hot path)."""
        space = self.action_space
        if isinstance(space, gym.spaces.Box):
            inside = actions.shape[1:] == space.shape and (actions >= space.low) & (actions <= space.high)
        else:
            inside = (actions >= space.start) & (actions < space.start + space.n)
        if not np.all(inside):
            raise ValueError(f"policy produced actions outside {space}: {np.asarray(actions).tolist()!r:.200}")

    def act_with_info(self, obs_batch: Any) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Actions plus action probabilities (discrete actor-critic) and state values (actor-critic)."""
        obs = self._batch(obs_batch)
        actions, _, values = self._net.sample(obs, None, deterministic=True)
        actions = self._net.env_actions(actions)
        self._check_actions(actions)
        has_critic = self._net.spec["kind"] in ("categorical", "gaussian")  # a Q network or an off-policy actor: none
        return actions, self._net.probs(obs), values if has_critic else None


def _policy_parts(trainer_or_policy: Any) -> tuple[Any, str, str | None, gym.Space, gym.Space]:
    """(torch policy, algorithm, env id, observation space, action space) from a trainer or a bare policy."""
    if hasattr(trainer_or_policy, "policy") and hasattr(trainer_or_policy, "algorithm"):
        t = trainer_or_policy
        return t.policy, t.algorithm, t.env_id, t.observation_space, t.action_space
    policy = trainer_or_policy
    spaces = getattr(policy, "observation_space", None), getattr(policy, "action_space", None)
    if spaces[0] is None:
        raise ValueError("export_policy needs a trainer, or a policy with observation_space/action_space attributes")
    algorithm = {"q": "dqn", "squashed_gaussian": "sac", "deterministic": "td3"}.get(policy.spec["kind"], "ppo")
    return policy, algorithm, None, *spaces


def export_policy(trainer_or_policy: Any, directory: str | os.PathLike, metadata: dict | None = None) -> Path:
    """Write ``policy.json`` (architecture, spaces, algorithm, env id, metadata) and ``weights.npz``."""
    policy, algorithm, env_id, obs_space, act_space = _policy_parts(trainer_or_policy)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    spec = {
        "format_version": FORMAT_VERSION,
        "algorithm": algorithm,
        "env_id": env_id,
        "architecture": policy.spec,
        "observation_space": space_to_json(obs_space),
        "action_space": space_to_json(act_space),
        "metadata": dict(metadata or {}),
    }
    json.dumps(spec)  # fail here, before writing, if metadata is not JSON-able
    for name, write in (
        (WEIGHTS_FILE, lambda fh: np.savez(fh, **policy.numpy_weights())),
        (SPEC_FILE, lambda fh: fh.write(json.dumps(spec, indent=2).encode())),
    ):
        atomic_write(directory / name, write)
    return directory


def load_policy(directory: str | os.PathLike) -> InferencePolicy:
    directory = Path(directory)
    spec_path = directory / SPEC_FILE
    if not spec_path.is_file():
        raise FileNotFoundError(f"no {SPEC_FILE} in {directory}: not a policy export")
    spec = json.loads(spec_path.read_text())
    if spec.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{spec_path}: format_version {spec.get('format_version')!r}, expected {FORMAT_VERSION}")
    with np.load(directory / WEIGHTS_FILE) as data:
        weights = {k: data[k] for k in data.files}
    return InferencePolicy(spec, weights)
