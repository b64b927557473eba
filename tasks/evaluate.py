"""Deterministic evaluation, cached on (model version, env, episodes, seed) with persisted results.

A registry reference is first pinned to its version (``resolve_model``) so that the cache key names
an immutable model and the evaluation loads exactly that version even if an alias moves meanwhile.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext
from pydantic import BaseModel

from opentinker.tasks.retry import IO_BACKOFF, IO_RETRIES, retry_transient
from opentinker.tasks.types import EvalOutcome


class ResolvedModel(BaseModel):
    """A model reference pinned to something immutable, and the cache key naming it."""

    uri: str
    key: str
    env_id: str
    store: str = ""
    """Digest of the tracking URI for registry models: versions are numbered per store, so keys must say which."""


@task(cache_policy=NO_CACHE, retries=IO_RETRIES, retry_delay_seconds=IO_BACKOFF, retry_condition_fn=retry_transient)
def resolve_model(model_uri: str, env_id: str | None = None) -> ResolvedModel:
    """``models:/NAME@alias`` → ``models:/NAME/VERSION``; an export dir → a digest of its files."""
    from opentinker.tracking.registry import resolve_policy

    ref = resolve_policy(model_uri)
    store = ""
    if ref.download_uri.startswith(("models:/", "runs:/")):
        from opentinker.infra.settings import get_settings

        store = hashlib.sha256(get_settings().tracking_uri.encode()).hexdigest()[:12]
    return ResolvedModel(
        uri=ref.download_uri, key=f"{ref.name}/{ref.version}", env_id=env_id or _env_of(ref.download_uri), store=store
    )


def _env_of(model_uri: str) -> str:
    from opentinker.tracking.registry import load_registered_policy

    spec = load_registered_policy(model_uri).spec
    env_id = spec.get("env_id") or spec.get("env") or (spec.get("metadata") or {}).get("env_id")
    if not env_id:
        raise ValueError(f"model {model_uri} records no env id; pass env_id explicitly")
    return str(env_id)


def _evaluation_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    model: ResolvedModel = parameters["model"]
    return (
        f"evaluate-{model.store or 'local'}-{model.key}-{model.env_id}-n{parameters['episodes']}-s{parameters['seed']}"
    )


@task(cache_key_fn=_evaluation_key, persist_result=True, retries=1, retry_delay_seconds=2)
def evaluate_policy(model: ResolvedModel, episodes: int = 10, seed: int = 10_000) -> EvalOutcome:
    """Run ``episodes`` deterministic episodes, episode i seeded ``seed + i``; mean and std of returns."""
    from opentinker.tracking.registry import load_registered_policy

    policy = load_registered_policy(model.uri)
    returns = play_episodes(model.env_id, lambda obs: policy.act(np.asarray(obs)[None])[0], episodes, seed)
    get_run_logger().info(
        "%s: mean return %.2f ± %.2f over %d episodes", model.key, np.mean(returns), np.std(returns), episodes
    )
    return EvalOutcome(
        model_key=model.key, seed=seed, returns=returns, mean=float(np.mean(returns)), std=float(np.std(returns))
    )


def play_episodes(env_id: str, act, episodes: int, seed: int) -> list[float]:
    """Returns of ``episodes`` episodes of ``act(obs) -> action``, episode i reset with ``seed + i``."""
    from opentinker.envs import make_env

    env = make_env(env_id)
    returns = []
    try:
        for episode in range(episodes):
            obs, _ = env.reset(seed=seed + episode)
            total, done = 0.0, False
            while not done:
                obs, reward, terminated, truncated, _ = env.step(act(obs))
                total += float(reward)
                done = bool(terminated or truncated)
            returns.append(total)
    finally:
        env.close()
    return returns


@task(cache_policy=NO_CACHE)
def evaluate_random_policy(env_id: str, episodes: int = 10, seed: int = 10_000) -> EvalOutcome:
    """The gate's floor when the env has no reward threshold: a uniform random policy on the evaluation seeds
    (its action space seeded with ``seed``)."""
    from opentinker.envs import make_env

    space = make_env(env_id).action_space
    space.seed(seed)
    returns = play_episodes(env_id, lambda obs: space.sample(), episodes, seed)
    return EvalOutcome(
        model_key=f"random/{env_id}",
        seed=seed,
        returns=returns,
        mean=float(np.mean(returns)),
        std=float(np.std(returns)),
    )


def reward_threshold(env_id: str) -> float | None:
    """The env spec's ``reward_threshold`` (None for unregistered envs and ids without one)."""
    from opentinker.envs import make_env

    env = make_env(env_id)
    try:
        return None if env.spec is None else env.spec.reward_threshold
    finally:
        env.close()
