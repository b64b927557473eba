"""Evaluation and release flows: evaluate a model on fixed seeds (cached), and the promotion gate."""

from prefect import flow

from opentinker.flows.params import EvalFlowResult, EvalParams
from opentinker.tasks.evaluate import evaluate_policy, evaluate_random_policy, resolve_model, reward_threshold
from opentinker.tasks.register import CANDIDATE, CHAMPION, find_model_version, promote_if_better
from opentinker.tasks.types import EvalOutcome, ModelRef


@flow(name="evaluate", log_prints=True)
def evaluate_flow(params: EvalParams) -> EvalFlowResult:
    """Evaluate one model version on fixed seeds; a rerun on the same version and seeds is a cache hit."""
    model = resolve_model(params.model_uri)
    state = evaluate_policy(model, params.episodes, params.seed, return_state=True)
    outcome: EvalOutcome = state.result()
    return EvalFlowResult(**outcome.model_dump(exclude={"seed"}), cached=state.name == "Cached")


@flow(name="release", log_prints=True)
def release_flow(
    model_name: str,
    version: str = CANDIDATE,
    episodes: int = 10,
    seed: int = 10_000,
    threshold: float | None = None,
    candidate_eval: EvalOutcome | None = None,
) -> ModelRef:
    """Promotion gate: candidate and champion evaluated on the same seeds; champion moves only on a strict win.

    ``threshold`` None: the env spec's ``reward_threshold``; for an env without one the candidate must beat the
    champion, and a first champion a random policy by a clear margin (``package.random_floor``).
    """
    candidate = find_model_version(model_name, version)
    if candidate is None:
        raise ValueError(f"model {model_name!r} has no version or alias {version!r}")
    if candidate_eval is None or threshold is None:
        candidate_model = resolve_model(f"models:/{model_name}/{candidate.version}")
        candidate_eval = candidate_eval or evaluate_policy(candidate_model, episodes, seed)
        threshold = threshold if threshold is not None else reward_threshold(candidate_model.env_id)
    champion = find_model_version(model_name, CHAMPION)
    champion_eval = None
    if champion is not None and champion.version != candidate.version:
        champion_model = resolve_model(f"models:/{model_name}/{champion.version}")
        champion_eval = evaluate_policy(champion_model, len(candidate_eval.returns), candidate_eval.seed)
    random_eval = None
    if threshold is None and champion_eval is None:
        random_eval = evaluate_random_policy(candidate_model.env_id, len(candidate_eval.returns), candidate_eval.seed)
    return promote_if_better(candidate, candidate_eval, champion, champion_eval, threshold, random_eval)
