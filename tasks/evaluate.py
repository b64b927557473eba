"""Evaluation of a model as it is served, cached on (model version, env, episodes, seed) with persisted results.

A registry reference is first pinned to its version (``resolve_model``) so that the cache key names
an immutable model and the evaluation loads exactly that version even if an alias moves meanwhile. The episodes are
the RL core's (``agents.evaluation.evaluate_served``: the action the export serves, and the other one beside it where
the policy is stochastic).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext

from opentinker.agents.evaluation import EvalResult, evaluate_episodes
from opentinker.envs.observations import batch_len
from opentinker.tasks.retry import io_task
from opentinker.tracking.registry import ModelRef, load_registered_policy, resolve_policy


@io_task
def resolve_model(model_uri: str) -> ModelRef:
    """``models:/NAME@alias`` → ``models:/NAME/VERSION``; an export dir → a digest of its files."""
    return resolve_policy(model_uri)


@io_task
def model_env_id(model: ModelRef) -> str:
    """The env id the model's export records (the env it was trained on)."""
    spec = load_registered_policy(model.download_uri).spec
    env_id = spec.get("env_id") or spec.get("env") or (spec.get("metadata") or {}).get("env_id")
    if not env_id:
        raise ValueError(f"model {model.uri or model.download_uri} records no env id; pass env_id explicitly")
    return str(env_id)


def _evaluation_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    """Registry versions are numbered per store, so a registry model's key also names the store."""
    from opentinker.infra.settings import get_settings

    model: ModelRef = parameters["model"]
    store = hashlib.sha256(get_settings().tracking_uri.encode()).hexdigest()[:12] if model.in_registry else "local"
    return f"evaluate-{store}-{model.key}-{parameters['env_id']}-n{parameters['episodes']}-s{parameters['seed']}"


@task(cache_key_fn=_evaluation_key, persist_result=True, retries=1, retry_delay_seconds=2)
def evaluate_policy(model: ModelRef, env_id: str, episodes: int = 10, seed: int = 10_000) -> EvalResult:
    """The RL core's evaluation of the exact version ``model`` pins, on ``env_id``, acting as it is served."""
    result = load_registered_policy(model.download_uri).evaluate(env_id, episodes, seed)
    other = result.alternative
    get_run_logger().info(
        "%s: mean return %.2f ± %.2f over %d episodes (%s actions, as served)%s",
        *(model.key, result.mean, result.std, episodes, result.action),
        f"; {other.action}: {other.mean:.2f} ± {other.std:.2f}" if other else "",
    )
    return dataclasses.replace(result, model_key=model.key)


@task(cache_policy=NO_CACHE)
def evaluate_random_policy(env_id: str, episodes: int = 10, seed: int = 10_000) -> EvalResult:
    """The gate's floor when the env has no reward threshold: a uniform random policy on the evaluation seeds
    (its action space seeded with ``seed``)."""
    from opentinker.envs import make_env

    space = make_env(env_id).action_space
    space.seed(seed)
    result = evaluate_episodes(
        env_id, lambda obs: np.stack([space.sample() for _ in range(batch_len(obs))]), episodes, seed
    )
    return dataclasses.replace(result, model_key=f"random/{env_id}")


def reward_threshold(env_id: str) -> float | None:
    """The env spec's ``reward_threshold`` (None for unregistered envs and ids without one)."""
    from opentinker.envs import make_env

    env = make_env(env_id)
    try:
        return None if env.spec is None else env.spec.reward_threshold
    finally:
        env.close()
