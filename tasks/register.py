"""Registry stages: log + register a candidate, look up the champion, and the promotion gate.

The gate only moves ``champion`` when the candidate passes the threshold and strictly beats the
current champion on the same evaluation seeds; ties and losses leave it untouched. The decision
and the numbers behind it are tags on the model version and on the MLflow run.
"""

from __future__ import annotations

from opentinker.agents.evaluation import EvalResult
from opentinker.tasks.retry import io_task
from opentinker.tracking.registry import (
    ModelRef,
    PolicyStoreError,
    log_policy_model,
    register_policy,
    resolve_policy,
    set_alias,
)
from opentinker.tracking.runs import configure_mlflow

CANDIDATE, CHAMPION = "candidate", "champion"


@io_task
def register_model(
    run_id: str, export_dir: str, model_name: str, evaluation: EvalResult | None = None, step: int = 0
) -> ModelRef:
    """Log the export as an MLflow pyfunc model of ``run_id`` (trained to env ``step``), register it as ``candidate``.

    ``evaluation``'s action (``evaluation.choose_served``) is recorded in the export first: the model serves it.
    Idempotent under retries: a version already registered from this run is reused, never duplicated.
    """
    import mlflow

    from opentinker.agents.export import record_served_action

    if evaluation is not None:
        record_served_action(export_dir, evaluation.action)
    configure_mlflow()
    client = mlflow.MlflowClient()
    existing = client.search_model_versions(f"name='{model_name}' and run_id='{run_id}'")
    tags = {} if evaluation is None else _eval_tags(evaluation)
    if existing:
        registered = existing[0]
        for key, value in tags.items():  # a retry: the first attempt may have failed before they were all set
            client.set_model_version_tag(model_name, str(registered.version), key, value)
    else:
        model_uri = log_policy_model(export_dir, run_id=run_id, step=step)
        registered = register_policy(model_uri, model_name, tags=tags)  # one write, not one per tag
    version = str(registered.version)
    model_id = registered.model_id or _logged_model_id(registered.source)
    set_alias(model_name, CANDIDATE, version)
    return ModelRef(
        uri=f"models:/{model_name}/{version}",
        name=model_name,
        version=version,
        run_id=run_id,
        download_uri=f"models:/{model_name}/{version}",
        aliases=[CANDIDATE],
        model_id=model_id,
    )


@io_task
def find_model_version(model_name: str, ref: str) -> ModelRef | None:
    """Version ``ref`` (a number or an alias such as ``champion``) of ``model_name``, or None if there is none."""
    try:
        return resolve_policy(f"models:/{model_name}/{ref}" if ref.isdigit() else f"models:/{model_name}@{ref}")
    except PolicyStoreError as exc:
        if getattr(exc.__cause__, "error_code", None) in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def random_floor(random_eval: EvalResult) -> float:
    """What a first champion must beat when the env has no threshold: the random policy's mean plus a clear margin
    (its std across episodes, and at least 10 % of its magnitude)."""
    return random_eval.mean + max(random_eval.std, 0.1 * abs(random_eval.mean))


def decide(
    candidate_mean: float, champion_mean: float | None, threshold: float | None, random_mean_floor: float | None = None
) -> tuple[bool, str]:
    """Pure promotion rule: pass the threshold, then strictly beat the champion (a tie keeps the champion).

    Without a threshold (the env has none) the candidate must beat the champion, and a first champion must beat
    ``random_mean_floor`` (``random_floor``).
    """
    if threshold is None and champion_mean is None:
        if random_mean_floor is None:
            raise ValueError("a gate without threshold needs the random policy's floor for a first champion")
        if candidate_mean > random_mean_floor:
            return True, (
                f"promoted: first champion, mean {candidate_mean:.2f} beats the random policy's floor "
                f"{random_mean_floor:.2f} (no reward threshold for this env)"
            )
        return False, (
            f"rejected: mean {candidate_mean:.2f} does not beat the random policy's floor {random_mean_floor:.2f}"
        )
    if threshold is not None and candidate_mean < threshold:
        return False, f"rejected: mean {candidate_mean:.2f} below threshold {threshold:.2f}"
    if champion_mean is None:
        return True, f"promoted: first champion, mean {candidate_mean:.2f} >= threshold {threshold:.2f}"
    if candidate_mean > champion_mean:
        return True, f"promoted: mean {candidate_mean:.2f} beats champion {champion_mean:.2f}"
    return False, f"kept champion: candidate {candidate_mean:.2f} does not beat champion {champion_mean:.2f}"


@io_task
def promote_if_better(
    candidate: ModelRef,
    candidate_eval: EvalResult,
    champion: ModelRef | None,
    champion_eval: EvalResult | None,
    threshold: float | None,
    random_eval: EvalResult | None = None,
) -> ModelRef:
    """Apply ``decide`` to what each model serves (each evaluation's ``action``); move ``champion`` only on a win;
    record decision, rule and numbers as tags."""
    import mlflow
    from mlflow.entities import RunTag

    if champion_eval is not None and (champion_eval.seed, len(champion_eval.returns)) != (
        candidate_eval.seed,
        len(candidate_eval.returns),
    ):
        raise ValueError("candidate and champion must be evaluated on the same seeds and episode count")
    if champion is not None and champion.version == candidate.version:
        promote, decision = False, "kept champion: candidate already is the champion"
    elif champion is not None and champion_eval is None:
        raise ValueError(f"champion {champion.name} v{champion.version} must be evaluated before the gate")
    else:
        floor = random_floor(random_eval) if random_eval is not None else None
        promote, decision = decide(candidate_eval.mean, champion_eval.mean if champion_eval else None, threshold, floor)
    decision = f"{decision} ({candidate_eval.action} actions, as served)"
    configure_mlflow()
    client = mlflow.MlflowClient()
    tags = {
        "gate.decision": decision,
        "gate.promoted": str(promote).lower(),
        "gate.rule": "threshold" if threshold is not None else "beat champion, first beats random policy",
        "gate.threshold": "" if threshold is None else f"{threshold:.4f}",
        "gate.random_mean": f"{random_eval.mean:.4f}" if random_eval else "",
        "gate.random_floor": f"{random_floor(random_eval):.4f}" if random_eval else "",
        "gate.candidate_version": candidate.version,
        "gate.candidate_mean": f"{candidate_eval.mean:.4f}",
        "gate.candidate_action": candidate_eval.action,
        "gate.champion_version": champion.version if champion else "",
        "gate.champion_mean": f"{champion_eval.mean:.4f}" if champion_eval else "",
        "gate.champion_action": champion_eval.action if champion_eval else "",
        "gate.eval_seed": str(candidate_eval.seed),
        "gate.eval_episodes": str(len(candidate_eval.returns)),
    }
    for key, value in tags.items():
        client.set_model_version_tag(candidate.name, candidate.version, key, value)
    if candidate.run_id:  # the run's copy in one write
        client.log_batch(candidate.run_id, tags=[RunTag(key, value) for key, value in tags.items()])
    client.update_model_version(candidate.name, candidate.version, description=f"Release gate: {decision}")
    aliases = list(candidate.aliases)
    if promote:
        set_alias(candidate.name, CHAMPION, candidate.version)
        aliases.append(CHAMPION)
    return candidate.model_copy(update={"aliases": aliases, "decision": decision})


def _logged_model_id(source: str) -> str:
    """``models:/m-…`` → ``m-…``: a version registered from a logged model's URI leaves its ``model_id`` empty."""
    return source.removeprefix("models:/") if source.startswith("models:/m-") else ""


def _eval_tags(evaluation: EvalResult) -> dict[str, str]:
    """The served action's numbers, and both actions' means (empty: not evaluated, a policy with only one)."""
    means = {action: evaluation.mean_of(action) for action in ("greedy", "sampled")}
    return {
        "eval.mean": f"{evaluation.mean:.4f}",
        "eval.std": f"{evaluation.std:.4f}",
        "eval.seed": str(evaluation.seed),
        "eval.episodes": str(len(evaluation.returns)),
        "eval.action": evaluation.action,
        **{f"eval.{action}_mean": "" if mean is None else f"{mean:.4f}" for action, mean in means.items()},
    }
