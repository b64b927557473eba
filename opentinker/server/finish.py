"""What trusted code makes of a child's result: the exports it sent loaded as data (JSON, ``np.load`` without
pickle, safetensors) and registered, the gate applied to the numbers it measured, the job's typed ``JobResult``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from opentinker.infra.files import atomic_write

from .channel import ChannelError, GroupResult, GRPOResult, PolicyResult, evaluation_result
from .schemas import JobResult, KindResult


def copy_champion(spec: Any, into: Path) -> tuple[Any, Path | None]:
    """The current champion of the job's model, its files copied into ``into`` (bound read-only into the child's
    sandbox) for the child to evaluate; (None, None) when there is none yet."""
    from opentinker.tasks.register import CHAMPION, find_model_version
    from opentinker.tasks.run import as_step

    if spec.algorithm == "group":
        return None, None
    if spec.algorithm == "grpo":
        from opentinker.tracking.llm_store import download_adapter
        from opentinker.tracking.registry import PolicyStoreError

        try:
            ref, folder = download_adapter(f"models:/{spec.resolved_model_name}@{CHAMPION}")
        except PolicyStoreError:
            return None, None
        shutil.copytree(folder, into, dirs_exist_ok=True)
        return ref, into
    from opentinker.tracking.registry import download_policy

    ref = as_step(find_model_version)(spec.resolved_model_name, CHAMPION)
    if ref is None:
        return None, None
    shutil.copytree(download_policy(ref), into, dirs_exist_ok=True)
    return ref, into


def _validated_export(directory: Path, run_id: str) -> None:
    """Load the job's export as data (JSON, the weights' headers checked against ``agents.export``'s limits before
    they are read, without pickle) before anything registers it, and stamp the MLflow run into its metadata."""
    from opentinker.agents.export import WeightsError
    from opentinker.tracking.registry import load_registered_policy

    name = "/".join(directory.parts[-2:]) if directory.parent.name == "exports" else directory.name
    spec_path = directory / "policy.json"
    if not spec_path.is_file() or spec_path.stat().st_size > 1 << 20:
        raise ChannelError(f"{name}: expected policy.json of at most 1 MiB")
    try:
        load_registered_policy(directory)  # refuses what is not the project's numpy export
    except WeightsError as exc:
        raise ChannelError(f"{name}: {exc}") from None
    spec = json.loads(spec_path.read_text())
    spec["metadata"] = {**(spec.get("metadata") or {}), "run_id": run_id}
    atomic_write(spec_path, json.dumps(spec))


def finish_policy(spec: Any, run: Any, result: PolicyResult, job_dir: Path, logger: Any, champion: Any) -> JobResult:
    """Register the validated export as ``candidate``, serving the action the child's returns favour (chosen here,
    recorded in the export), apply the gate to the numbers the child measured, reports."""
    from opentinker.agents.evaluation import choose_served
    from opentinker.flows.train import publish_policy
    from opentinker.tasks.register import promote_if_better, register_model
    from opentinker.tasks.types import TrainOutcome

    export_dir = job_dir / "export"
    _validated_export(export_dir, run.run_id)
    evaluation = choose_served(evaluation_result(result.evaluation, f"run/{run.run_id}"))
    candidate = register_model(
        run.run_id, str(export_dir), spec.resolved_model_name, evaluation, step=result.global_step
    )
    champion_eval = random_eval = None
    if champion is not None and result.champion_evaluation is not None:
        champion_eval = evaluation_result(result.champion_evaluation, champion.key)
    if result.random_evaluation is not None:
        random_eval = evaluation_result(result.random_evaluation, f"random/{spec.env_id}")
    if champion is not None and champion_eval is None:
        champion = None  # the child could not evaluate it: the gate then judges the candidate alone
    released = promote_if_better(candidate, evaluation, champion, champion_eval, result.threshold, random_eval)
    trained = TrainOutcome(
        run_id=run.run_id,
        checkpoint_path=str(job_dir / "checkpoints" / "checkpoint.pt"),
        export_dir=str(export_dir),
        history_path=str(logger.save_history(job_dir / "history.jsonl")),
        start_step=result.start_step,
        global_step=result.global_step,
        iterations=len(logger.history),
        train_seconds=result.train_seconds,
    )
    publish_policy(spec, run, trained, evaluation, released, candidate.model_id)
    return JobResult(
        kind="policy",
        run_id=run.run_id,
        experiment_id=run.tracking.experiment_id,
        model_name=released.name,
        model_version=released.version,
        aliases=released.aliases,
        decision=released.decision,
        eval_mean=evaluation.mean,
        eval_std=evaluation.std,
        eval_action=evaluation.action,
        global_step=result.global_step,
    )


def finish_group(spec: Any, run: Any, result: GroupResult, job_dir: Path) -> JobResult:
    """One registered model per agent kind, from its validated export."""
    from opentinker.tasks.register import register_model

    kinds = {}
    for kind, reported in result.evaluations.items():
        export_dir = job_dir / "exports" / kind
        _validated_export(export_dir, run.run_id)
        evaluation = evaluation_result(reported, f"{run.run_id}/{kind}")
        name = f"{spec.resolved_model_name}-{kind}"
        ref = register_model(run.run_id, str(export_dir), name, evaluation, step=result.global_step)
        kinds[kind] = KindResult(
            model_name=name, model_version=ref.version, eval_mean=evaluation.mean, eval_std=evaluation.std
        )
    run.summarise(
        metrics={f"eval/{kind}/mean": k.eval_mean for kind, k in kinds.items()},
        step=result.global_step,
        tags={f"opentinker.model.{kind}": f"{k.model_name}/{k.model_version}" for kind, k in kinds.items()},
    )
    return JobResult(
        kind="group",
        run_id=run.run_id,
        experiment_id=run.tracking.experiment_id,
        model_name=spec.resolved_model_name,
        model_version="",
        aliases=["candidate"],
        decision="registered one model per agent kind (no gate)",
        global_step=result.global_step,
        kinds=kinds,
    )


MAX_SAFETENSORS_HEADER = 16 << 20
"""Bytes of the adapter's safetensors header (a LoRA adapter's few hundred tensors take tens of KB): safetensors
itself allows 100 MB, parsed in this trusted process."""


def _validated_adapter(directory: Path) -> None:
    """The adapter's data files (the channel let no others in): the configs' JSON must parse, safetensors must load
    (its header bounded first), and a config may name no code to import (``auto_map``). The tokenizer's data is left
    to the tokenizers library, which reads it as data."""
    from safetensors import safe_open

    from .channel import TOKENIZER_DATA

    weights = directory / "adapter_model.safetensors"
    with weights.open("rb") as handle:
        header = int.from_bytes(handle.read(8), "little")
    if header > MAX_SAFETENSORS_HEADER:
        raise ChannelError(
            f"adapter/{weights.name}: a header of {header} bytes declared; at most {MAX_SAFETENSORS_HEADER}"
        )
    for path in directory.iterdir():
        if path.suffix == ".json" and path.name not in TOKENIZER_DATA:
            data = json.loads(path.read_text())
            if isinstance(data, dict) and data.pop("auto_map", None) is not None:
                atomic_write(path, json.dumps(data))
    with safe_open(str(weights), framework="pt"):
        pass


def finish_grpo(spec: Any, run: Any, result: GRPOResult, job_dir: Path, champion: Any) -> JobResult:
    """Register the validated adapter as ``candidate``; the gate compares the held-out success the child measured
    for it and for the champion on the same prompts."""
    from opentinker.flows.grpo import summarise_adapter
    from opentinker.tasks.llm import LLMEvaluation, decide_adapter, register_adapter
    from opentinker.tasks.run import as_step

    adapter_dir = job_dir / "adapter"
    _validated_adapter(adapter_dir)
    config = spec.engine.config(task=spec.env_id)
    version = as_step(register_adapter)(
        run.run_id, str(adapter_dir), spec.resolved_model_name, config.base_model, spec.env_id
    )
    candidate = LLMEvaluation(**result.evaluation.model_dump())
    champion_success = result.champion_success if champion is not None and champion.version != version else None
    gate = decide_adapter(
        spec.resolved_model_name, version, candidate, champion, champion_success, spec.champion_threshold or 0.0
    )
    summarise_adapter(run, gate, config.base_model, candidate, result.completions_per_s, result.updates)
    return JobResult(
        kind="grpo",
        run_id=run.run_id,
        experiment_id=run.tracking.experiment_id,
        model_name=spec.resolved_model_name,
        model_version=version,
        aliases=gate.aliases,
        decision=gate.decision,
        heldout_success=candidate.success,
        global_step=result.updates,
    )
