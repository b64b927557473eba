"""Deterministic evaluation, numpy only: the one evaluation function and its result type.

``Trainer.evaluate``, ``GroupTrainer.evaluate`` (per kind) and the pipeline's evaluate task all return ``EvalResult``;
the task runs ``evaluate_episodes`` on a registered model's numpy policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from opentinker.envs.rollout import build_vector_env


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Deterministic evaluation: the returns of episodes seeded ``seed + i``, their mean and std.

    The one evaluation type: the RL core fills the numbers, the pipeline says which model (``model_key``) and whether
    Prefect's cache answered; a multi-agent kind adds its episode lengths and share of terminated episodes.
    """

    mean: float
    std: float
    returns: list[float]
    seed: int | None = None
    model_key: str = ""
    """What was evaluated: registry ``name/version``, ``run/<id>``, a weights digest or ``random/<env>``."""
    mean_length: float | None = None
    terminated_fraction: float | None = None
    cached: bool = False

    @classmethod
    def of(cls, returns: list[float] | np.ndarray, **fields: Any) -> EvalResult:
        returns = [float(r) for r in returns]
        return cls(float(np.mean(returns)), float(np.std(returns)), returns, **fields)


def policy_act(policy: Any, deterministic: bool = True, seed: int = 0) -> Callable[[Any], np.ndarray]:
    """``act(obs_batch) -> env actions`` of a numpy policy (``NumpyPolicy``): the mode of its distribution (what is
    served), or with ``deterministic=False`` a draw from it (what training collected with), seeded by ``seed``. A
    stochastic policy whose greedy action is worse than its samples shows as a gap between the two evaluations."""
    rng = None if deterministic else np.random.default_rng(seed)
    return lambda obs: policy.env_actions(policy.sample(obs, rng, deterministic)[0])


def evaluate_episodes(
    env: Any, act: Callable[[np.ndarray], np.ndarray], episodes: int = 10, seed: int = 10_000, **env_kwargs: Any
) -> EvalResult:
    """The RL core's evaluation: ``act(obs_batch) -> env actions`` on ``episodes`` env copies reset with ``seed``
    (a gymnasium vector env seeds copy i with ``seed + i``), each played to the end of its first episode."""
    vec = build_vector_env(env, episodes, **env_kwargs)
    try:
        obs, _ = vec.reset(seed=seed)
        returns, finished = np.zeros(episodes), np.zeros(episodes, dtype=bool)
        while not finished.all():
            obs, reward, term, trunc, _ = vec.step(act(obs))
            returns += np.where(finished, 0.0, reward)
            finished |= term | trunc
    finally:
        vec.close()
    return EvalResult.of(returns, seed=seed)
