"""Numpy-only forward pass of the MLP policies: used by rollout workers, evaluation and exported models.

A policy is fully described by a JSON-able ``spec`` plus a dict of float32 arrays named like the torch
``state_dict`` (``actor.0.weight`` ...). Workers and servers need neither torch nor the training code.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

POLICY_KINDS = ("categorical", "gaussian", "q", "squashed_gaussian", "deterministic")
TANH_KINDS = ("squashed_gaussian", "deterministic")
"""Actors of SAC and TD3: actions in [-1, 1] (what their critics and replay buffers see), scaled to the Box bounds
by ``env_actions``; no critic travels with them."""
LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0
"""Bounds of the squashed-Gaussian actor's log standard deviation (SB3's, from the SAC authors' code)."""
_ACTIVATIONS = {"tanh": np.tanh, "relu": lambda x: np.maximum(x, 0.0)}


def preprocess_obs(obs: np.ndarray, spec: dict[str, Any], weights: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """Batch of raw observations -> float32 matrix (Box: flattened, normalised when the spec says so with the
    ``obs_mean``/``obs_var`` of ``weights``; Discrete: one-hot)."""
    if spec["obs_kind"] == "discrete":
        idx = np.asarray(obs, dtype=np.int64).reshape(-1)
        out = np.zeros((idx.shape[0], spec["obs_dim"]), dtype=np.float32)
        out[np.arange(idx.shape[0]), idx] = 1.0
        return out
    x = np.asarray(obs, dtype=np.float32).reshape(-1, spec["obs_dim"])
    if "obs_norm" in spec:
        clip = spec["obs_norm"]["clip"]
        x = np.clip((x - weights["obs_mean"]) / np.sqrt(weights["obs_var"] + np.float32(1e-8)), -clip, clip)
    return x


class NumpyPolicy:
    """The MLP of ``spec`` evaluated with numpy; ``sample`` draws actions from an explicit Generator."""

    def __init__(self, spec: dict[str, Any], weights: dict[str, np.ndarray]):
        if spec.get("kind") not in POLICY_KINDS:
            raise ValueError(f"policy spec 'kind' must be one of {POLICY_KINDS}, got {spec.get('kind')!r}")
        self.spec = spec
        self.weights = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}
        self._act = _ACTIVATIONS[spec["activation"]]
        self._depth = len(spec["hidden"]) + 1

    def _mlp(self, head: str, x: np.ndarray) -> np.ndarray:
        for layer in range(self._depth):
            x = x @ self.weights[f"{head}.{2 * layer}.weight"].T + self.weights[f"{head}.{2 * layer}.bias"]
            if layer < self._depth - 1:
                x = self._act(x)
        return x

    def values(self, obs: np.ndarray) -> np.ndarray:
        """State values (actor-critic) or max Q (Q network), shape (batch,)."""
        x = preprocess_obs(obs, self.spec, self.weights)
        if self.spec["kind"] == "q":
            return self._mlp("q", x).max(axis=1)
        if self.spec["kind"] in TANH_KINDS:
            return np.zeros(x.shape[0], np.float32)
        return self._mlp("critic", x)[:, 0]

    def sample(self, obs: np.ndarray, rng: np.random.Generator | None, deterministic: bool = False):
        """Actions, their log-probabilities and state values for a batch; ``rng`` unused when deterministic."""
        x = preprocess_obs(obs, self.spec, self.weights)
        kind = self.spec["kind"]
        n = x.shape[0]
        if kind == "q":
            q = self._mlp("q", x)
            actions = q.argmax(axis=1)
            eps = float(self.spec.get("epsilon", 0.0))
            if not deterministic and eps > 0.0:
                explore = rng.random(n) < eps
                actions = np.where(explore, rng.integers(0, q.shape[1], size=n), actions)
            return actions.astype(np.int64), np.zeros(n, np.float32), q.max(axis=1)
        if kind in TANH_KINDS:
            return self._tanh_actions(x, rng, deterministic), np.zeros(n, np.float32), np.zeros(n, np.float32)
        values = self._mlp("critic", x)[:, 0]
        out = self._mlp("actor", x)
        if kind == "categorical":
            logits = out - out.max(axis=1, keepdims=True)
            logp_all = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
            if deterministic:
                actions = logp_all.argmax(axis=1)
            else:
                cdf = np.cumsum(np.exp(logp_all), axis=1)
                actions = np.minimum((cdf < rng.random(n)[:, None] * cdf[:, -1:]).sum(axis=1), out.shape[1] - 1)
            return actions.astype(np.int64), logp_all[np.arange(n), actions], values
        log_std = self.weights["log_std"].reshape(1, -1)
        std = np.exp(log_std)
        actions = out if deterministic else out + std * rng.standard_normal(out.shape).astype(np.float32)
        logp = (-0.5 * ((actions - out) / std) ** 2 - log_std - 0.5 * math.log(2 * math.pi)).sum(axis=1)
        return actions.astype(np.float32), logp.astype(np.float32), values

    def _tanh_actions(self, x: np.ndarray, rng: np.random.Generator | None, deterministic: bool) -> np.ndarray:
        """SAC's ``tanh(mean + std * noise)`` or TD3's ``clip(tanh(mu) + noise)`` in [-1, 1]; deterministic: the
        tanh of the mean. While collecting, ``spec["uniform_actions"]`` draws uniform actions (the warm-up) and
        ``spec["action_noise"]`` is TD3's exploration noise std."""
        dim = self.spec["action_dim"]
        out = self._mlp("actor", x)
        if deterministic:
            return np.tanh(out[:, :dim]).astype(np.float32)
        if self.spec.get("uniform_actions"):
            return rng.uniform(-1.0, 1.0, (x.shape[0], dim)).astype(np.float32)
        if self.spec["kind"] == "squashed_gaussian":
            std = np.exp(np.clip(out[:, dim:], LOG_STD_MIN, LOG_STD_MAX))
            return np.tanh(out[:, :dim] + std * rng.standard_normal(std.shape)).astype(np.float32)
        noise = float(self.spec.get("action_noise", 0.0)) * rng.standard_normal(out.shape)
        return np.clip(np.tanh(out) + noise, -1.0, 1.0).astype(np.float32)

    def probs(self, obs: np.ndarray) -> np.ndarray | None:
        """Action probabilities for discrete actor-critic policies, else None."""
        if self.spec["kind"] != "categorical":
            return None
        out = self._mlp("actor", preprocess_obs(obs, self.spec, self.weights))
        e = np.exp(out - out.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        """Policy outputs -> what the env accepts (continuous actions clipped to the action bounds)."""
        if self.spec["kind"] == "gaussian":
            return np.clip(actions, self.spec["action_low"], self.spec["action_high"]).astype(np.float32)
        if self.spec["kind"] in TANH_KINDS:
            low, high = np.asarray(self.spec["action_low"]), np.asarray(self.spec["action_high"])
            return np.clip(low + (actions + 1.0) * 0.5 * (high - low), low, high).astype(np.float32)
        return actions

    def act(self, obs: np.ndarray, deterministic: bool = True) -> np.ndarray:
        """Env-ready actions for a batch of observations.

        The greedy path runs only the actor (or Q) head: serving needs neither values nor log-probabilities.
        """
        if not deterministic:
            return self.env_actions(self.sample(obs, np.random.default_rng(), False)[0])
        kind = self.spec["kind"]
        if kind in TANH_KINDS:
            return self.env_actions(self._tanh_actions(preprocess_obs(obs, self.spec, self.weights), None, True))
        out = self._mlp("q" if kind == "q" else "actor", preprocess_obs(obs, self.spec, self.weights))
        if kind == "gaussian":
            return self.env_actions(out)
        return out.argmax(axis=1).astype(np.int64)
