"""Evaluation, numpy only: the one evaluation function and its result type, and which action a policy serves.

``Trainer.evaluate``, ``GroupTrainer.evaluate`` (per kind) and the pipeline's evaluate task all return ``EvalResult``;
the task runs ``evaluate_served`` on a registered model's numpy policy: the action it serves and, for a stochastic
policy, the other one on the same seeds. A fresh policy serves its greedy action unless sampling clearly beats it
(``choose_served``); the choice is recorded in its export, so serving, later evaluations and the gate follow it.
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
    action: str = "greedy"
    """How the episodes acted: ``greedy`` (the mode of each action's distribution) or ``sampled`` (drawn from it, as
    in training). In the pipeline, the action the model serves."""
    alternative: EvalResult | None = None
    """A stochastic policy's evaluation with the other action on the same seeds: evaluation reports both."""

    def mean_of(self, action: str) -> float | None:
        """The mean return acting ``action`` (None when that action was not evaluated)."""
        for result in (self, self.alternative):
            if result is not None and result.action == action:
                return result.mean
        return None

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


ACTIONS = ("greedy", "sampled")
DETERMINISTIC_KINDS = ("q", "deterministic")
"""Policy kinds whose only action is greedy: DQN's epsilon and TD3's noise explore during training, they are not a
distribution to serve."""


def evaluate_served(
    policy: Any, served: str, env: Any, episodes: int = 10, seed: int = 10_000, **env_kwargs: Any
) -> EvalResult:
    """The numpy ``policy`` acting ``served`` (what it answers when served), with the other action's evaluation on the
    same seeds beside it (``alternative``) when the policy is stochastic."""
    actions = ACTIONS if policy.kind not in DETERMINISTIC_KINDS else ("greedy",)
    results = {
        action: dataclasses.replace(
            evaluate_episodes(env, policy_act(policy, action == "greedy", seed), episodes, seed, **env_kwargs),
            action=action,
        )
        for action in actions
    }
    other = next((results[a] for a in actions if a != served), None)
    return dataclasses.replace(results[served], alternative=other)


def choose_served(evaluation: EvalResult) -> EvalResult:
    """The evaluation of what a fresh policy should serve: its greedy action, unless sampling beats it by more than
    the standard error of their difference (a mixed strategy, or a mode that is not yet the best action); then the
    sampled one, with the greedy one beside it."""
    results = {r.action: r for r in (evaluation, evaluation.alternative) if r is not None}
    greedy, sampled = results["greedy"], results.get("sampled")
    if sampled is None:
        return dataclasses.replace(greedy, alternative=None)
    margin = float(np.sqrt((greedy.std**2 + sampled.std**2) / len(greedy.returns)))
    served, other = (sampled, greedy) if sampled.mean - greedy.mean > margin else (greedy, sampled)
    return dataclasses.replace(served, alternative=dataclasses.replace(other, alternative=None))


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
