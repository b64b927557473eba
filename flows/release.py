"""Evaluation and release flows: evaluate a model on fixed seeds (cached), and the promotion gate."""

import dataclasses

from prefect import flow

from opentinker.agents.evaluation import EvalResult
from opentinker.flows.params import EvalParams
from opentinker.tasks.evaluate import (
    evaluate_policy,
    evaluate_random_policy,
    model_env_id,
    resolve_model,
    reward_threshold,
)
from opentinker.tasks.register import CANDIDATE, CHAMPION, find_model_version, promote_if_better
from opentinker.tracking.registry import ModelRef


@flow(name="evaluate", log_prints=True)
def evaluate_flow(params: EvalParams) -> EvalResult:
    """Evaluate one model version on fixed seeds; a rerun on the same version and seeds is a cache hit."""
    model = resolve_model(params.model_uri)
    state = evaluate_policy(model, model_env_id(model), params.episodes, params.seed, return_state=True)
    return dataclasses.replace(state.result(), cached=state.name == "Cached")


@flow(name="release", log_prints=True)
def release_flow(
    model_name: str,
    version: str = CANDIDATE,
    episodes: int = 10,
    seed: int = 10_000,
    threshold: float | None = None,
    candidate_eval: EvalResult | None = None,
) -> ModelRef:
    """Promotion gate: candidate and champion evaluated on the same seeds; champion moves only on a strict win.

    ``threshold`` None: the env spec's ``reward_threshold``; for an env without one the candidate must beat the
    champion, and a first champion a random policy by a clear margin (``register.random_floor``).
    """
    candidate = find_model_version(model_name, version)
    if candidate is None:
        raise ValueError(f"model {model_name!r} has no version or alias {version!r}")
    if candidate_eval is None or threshold is None:
        env_id = model_env_id(candidate)
        candidate_eval = candidate_eval or evaluate_policy(candidate, env_id, episodes, seed)
        threshold = threshold if threshold is not None else reward_threshold(env_id)
    champion = find_model_version(model_name, CHAMPION)
    champion_eval = None
    if champion is not None and champion.version != candidate.version:
        champion_eval = evaluate_policy(
            champion, model_env_id(champion), len(candidate_eval.returns), candidate_eval.seed
        )
    random_eval = None
    if threshold is None and champion_eval is None:
        random_eval = evaluate_random_policy(env_id, len(candidate_eval.returns), candidate_eval.seed)
    return promote_if_better(candidate, candidate_eval, champion, champion_eval, threshold, random_eval)
