"""Numpy-only forward pass of the policies: used by rollout workers, evaluation and exported models.

A policy is fully described by a JSON-able ``spec`` plus a dict of float32 arrays named like the torch
``state_dict`` (``features.0.convs.0.weight``, ``actor.0.weight`` ...). Workers and servers need neither torch nor the
training code. The feature extractor is ``numpy_features.NumpyFeatures``; this module holds the heads: one per action
kind (``POLICY_KINDS``), each with its sampling rule and its deterministic (greedy / mean) action.

Actor-critic kinds (PPO): ``categorical`` (Discrete), ``multi_categorical`` (MultiDiscrete: one categorical per
dimension), ``bernoulli`` (MultiBinary), ``gaussian`` (Box; state-independent log std, actions clipped to the bounds).
``q`` (DQN): greedy, epsilon-greedy while collecting (``spec["epsilon"]``). Actor-only kinds for off-policy continuous
control, acting in [-1, 1] and scaled to the Box bounds by ``env_actions``: ``squashed_gaussian`` (SAC: tanh of a
Gaussian sample, deterministic = tanh(mean)) and ``deterministic`` (TD3: tanh of the actor's output, plus
``spec["action_noise"]`` Gaussian noise while collecting). With ``spec["uniform_actions"]`` both act uniformly at
random (before learning starts).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from opentinker.envs.numpy_features import NumpyFeatures

POLICY_KINDS = ("categorical", "multi_categorical", "bernoulli", "gaussian", "q", "squashed_gaussian", "deterministic")
ACTOR_ONLY = ("squashed_gaussian", "deterministic")
_ACTIVATIONS = {"tanh": np.tanh, "relu": lambda x: np.maximum(x, 0.0)}
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
LOG_STD_BOUNDS = (-5.0, 2.0)
"""The squashed Gaussian's log std range (CleanRL's SAC): the actor's raw output is mapped into it by a tanh."""


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits - logits.max(axis=1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))


def sample_categorical(logp_all: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One draw per row by inverting the CDF (a single uniform per row)."""
    cdf = np.cumsum(np.exp(logp_all), axis=1)
    return np.minimum((cdf < rng.random(len(cdf))[:, None] * cdf[:, -1:]).sum(axis=1), logp_all.shape[1] - 1)


def log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


def squashed_log_std(raw: np.ndarray) -> np.ndarray:
    low, high = LOG_STD_BOUNDS
    return low + 0.5 * (high - low) * (np.tanh(raw) + 1.0)


class ActionMap:
    """Policy outputs -> what the env accepts: continuous actions clipped (Gaussian) or scaled from [-1, 1]
    (actor-only kinds) to the Box bounds, indices shifted by the space's ``start``, the space's shape restored.
    Everything it needs is read from the spec once: rollout workers call it every step."""

    def __init__(self, spec: dict[str, Any]):
        self.kind = spec["kind"]
        if "action_low" in spec:
            self.low, self.high = (np.asarray(spec[k], np.float32) for k in ("action_low", "action_high"))
        start = np.asarray(spec.get("action_start", 0), np.int64)
        self.start = start if np.any(start) else None
        shape = spec.get("action_shape")
        self.shape = tuple(shape) if shape is not None and len(shape) != 1 else None

    def __call__(self, actions: np.ndarray) -> np.ndarray:
        if self.kind == "gaussian":
            actions = np.clip(actions, self.low, self.high).astype(np.float32)
        elif self.kind in ACTOR_ONLY:
            actions = (self.low + 0.5 * (actions + 1.0) * (self.high - self.low)).astype(np.float32)
        elif self.start is not None:
            actions = actions + self.start
        return actions if self.shape is None else actions.reshape(len(actions), *self.shape)


class NumpyPolicy:
    """The network of ``spec`` evaluated with numpy; ``sample`` draws actions from an explicit Generator."""

    def __init__(self, spec: dict[str, Any], weights: dict[str, np.ndarray]):
        if spec.get("kind") not in POLICY_KINDS:
            raise ValueError(f"policy spec 'kind' must be one of {POLICY_KINDS}, got {spec.get('kind')!r}")
        self.spec, self.kind = spec, spec["kind"]
        self.weights = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}
        self.features = NumpyFeatures(spec, self.weights)
        self.env_actions = ActionMap(spec)
        """Policy outputs -> env actions (``ActionMap``)."""
        self._act = _ACTIVATIONS[spec["activation"]]
        self._depth = len(spec["hidden"]) + 1
        self._head = "q" if self.kind == "q" else "actor"
        self.nvec = spec.get("action_nvec")
        if self.nvec is not None:
            self._splits = np.cumsum(self.nvec)[:-1]

    def _mlp(self, head: str, x: np.ndarray) -> np.ndarray:
        for layer in range(self._depth):
            x = x @ self.weights[f"{head}.{2 * layer}.weight"].T + self.weights[f"{head}.{2 * layer}.bias"]
            if layer < self._depth - 1:
                x = self._act(x)
        return x

    def _values(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """State values from features ``x`` (``out``: the Q head's output when already computed)."""
        if self.kind == "q":
            return (self._mlp("q", x) if out is None else out).max(axis=1)
        if self.kind in ACTOR_ONLY:
            return np.zeros(x.shape[0], np.float32)
        return self._mlp("critic", x)[:, 0]

    def values(self, obs: Any) -> np.ndarray:
        """State values (actor-critic), max Q (Q network) or zeros (actor-only), shape (batch,)."""
        return self._values(self.features(obs))

    def sample(self, obs: Any, rng: np.random.Generator | None, deterministic: bool = False):
        """Actions, their log-probabilities and state values for a batch; ``rng`` unused when deterministic.

        Actions are the policy's own (indices from 0, flattened; [-1, 1] for actor-only kinds): ``env_actions``
        turns them into what the env takes.
        """
        x = self.features(obs)
        n, kind = x.shape[0], self.kind
        out = self._mlp(self._head, x)
        values = self._values(x, out)
        if kind == "q":
            actions = out.argmax(axis=1)
            eps = float(self.spec.get("epsilon", 0.0))
            if not deterministic and eps > 0.0:
                explore = rng.random(n) < eps
                actions = np.where(explore, rng.integers(0, out.shape[1], size=n), actions)
            return actions.astype(np.int64), np.zeros(n, np.float32), values
        if kind == "categorical":
            logp_all = log_softmax(out)
            actions = logp_all.argmax(axis=1) if deterministic else sample_categorical(logp_all, rng)
            return actions.astype(np.int64), logp_all[np.arange(n), actions], values
        if kind == "multi_categorical":
            columns, logp = [], np.zeros(n, np.float32)
            for logits in np.split(out, self._splits, axis=1):
                logp_all = log_softmax(logits)
                action = logp_all.argmax(axis=1) if deterministic else sample_categorical(logp_all, rng)
                columns.append(action)
                logp += logp_all[np.arange(n), action]
            return np.stack(columns, axis=1).astype(np.int64), logp, values
        if kind == "bernoulli":
            bits = out > 0 if deterministic else rng.random(out.shape) < 1.0 / (1.0 + np.exp(-out))
            logp = np.where(bits, log_sigmoid(out), log_sigmoid(-out)).sum(axis=1)
            return bits.astype(np.int8), logp.astype(np.float32), values
        if kind == "gaussian":
            log_std = self.weights["log_std"].reshape(1, -1)
            std = np.exp(log_std)
            actions = out if deterministic else out + std * rng.standard_normal(out.shape).astype(np.float32)
            logp = (-0.5 * ((actions - out) / std) ** 2 - log_std - _HALF_LOG_2PI).sum(axis=1)
            return actions.astype(np.float32), logp.astype(np.float32), values
        return (*self._sample_actor_only(out, rng, deterministic), values)

    def _sample_actor_only(self, out: np.ndarray, rng: np.random.Generator | None, deterministic: bool):
        """(actions in [-1, 1], log-probabilities) of the SAC / TD3 actors."""
        dim = self.spec["action_dim"]
        n = out.shape[0]
        if not deterministic and self.spec.get("uniform_actions"):
            return rng.uniform(-1.0, 1.0, (n, dim)).astype(np.float32), np.zeros(n, np.float32)
        if self.kind == "deterministic":
            actions = np.tanh(out)
            noise = float(self.spec.get("action_noise", 0.0))
            if not deterministic and noise > 0.0:
                actions = np.clip(actions + noise * rng.standard_normal(actions.shape), -1.0, 1.0)
            return actions.astype(np.float32), np.zeros(n, np.float32)
        mean, log_std = out[:, :dim], squashed_log_std(out[:, dim:])
        if deterministic:
            return np.tanh(mean).astype(np.float32), np.zeros(n, np.float32)
        noise = rng.standard_normal(mean.shape).astype(np.float32)
        pre_tanh = mean + np.exp(log_std) * noise
        # log N(u) - log|d tanh(u)/du|, with log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u)) (stable).
        logp = (-0.5 * noise**2 - log_std - _HALF_LOG_2PI).sum(axis=1)
        logp -= (2.0 * (math.log(2.0) - pre_tanh - np.logaddexp(0.0, -2.0 * pre_tanh))).sum(axis=1)
        return np.tanh(pre_tanh).astype(np.float32), logp.astype(np.float32)

    def probs(self, obs: Any) -> np.ndarray | None:
        """Action probabilities of discrete actor-critic policies (MultiDiscrete: each dimension's, concatenated;
        MultiBinary: each bit's probability of 1), else None."""
        if self.kind not in ("categorical", "multi_categorical", "bernoulli"):
            return None
        out = self._mlp("actor", self.features(obs))
        if self.kind == "bernoulli":
            return 1.0 / (1.0 + np.exp(-out))
        groups = np.split(out, self._splits, axis=1) if self.kind == "multi_categorical" else [out]
        return np.concatenate([np.exp(log_softmax(logits)) for logits in groups], axis=1)

    def act(self, obs: Any, deterministic: bool = True) -> np.ndarray:
        """Env-ready actions for a batch of observations.

        The greedy path runs only the actor (or Q) head: serving needs neither values nor log-probabilities.
        """
        if not deterministic or self.kind not in ("categorical", "q", "gaussian"):
            rng = None if deterministic else np.random.default_rng()
            return self.env_actions(self.sample(obs, rng, deterministic)[0])
        out = self._mlp(self._head, self.features(obs))
        if self.kind == "gaussian":
            return self.env_actions(out)
        return self.env_actions(out.argmax(axis=1).astype(np.int64))
