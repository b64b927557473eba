"""A GRPO run (``engine.algorithm == "grpo"``) inside ``train_flow``: probe the text env → train (rollout workers)
→ evaluate held-out → register the adapter → champion gate. ``opentinker train TASK --algo grpo`` runs it, for a
shipped task or your own ``module:factory``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from opentinker.tasks.llm import (
    GateDecision,
    LLMEvaluation,
    evaluate_adapter,
    gate_adapter,
    probe_text_env,
    register_adapter,
    train_grpo,
)
from opentinker.tasks.run import tracked_run
from opentinker.tasks.spec import RunSpec


class GRPOFlowResult(BaseModel):
    run_id: str
    run_url: str
    model_name: str
    model_version: str
    aliases: list[str]
    decision: str
    base_eval: LLMEvaluation | None
    evaluation: LLMEvaluation
    champion_success: float | None
    updates: int
    """Optimiser updates reached (GRPO's budget unit)."""
    train_seconds: float
    completions_per_s: float
    adapter_dir: str
    checkpoint_path: str


def grpo_run(spec: RunSpec) -> GRPOFlowResult:
    """Train, evaluate, register and (maybe) promote one LoRA adapter; one MLflow run."""
    config = spec.engine.config(task=spec.env_id)
    probe_text_env(spec.env_id, config.task_seed)
    with tracked_run(spec.config_form(), spec.resolved_run_name, spec.experiment) as run:
        trained = train_grpo(run.run_id, spec)
        evaluation = evaluate_adapter(
            trained.adapter_dir,
            config.eval_prompts,
            config.eval_batch,
            config.cache_dir,
            run_id=run.run_id,
            step=trained.updates,
        )
        version = register_adapter(
            run.run_id, trained.adapter_dir, spec.resolved_model_name, config.base_model, spec.env_id
        )
        gate: GateDecision = gate_adapter(
            spec.resolved_model_name,
            version,
            evaluation,
            spec.champion_threshold,
            config.eval_batch,
            config.cache_dir,
        )
        summarise_adapter(run, gate, config.base_model, evaluation, trained.completions_per_s, trained.updates)
    return GRPOFlowResult(
        run_id=run.run_id,
        run_url=run.tracking.url,
        model_name=spec.resolved_model_name,
        model_version=version,
        aliases=gate.aliases,
        decision=gate.decision,
        base_eval=trained.base_eval,
        evaluation=evaluation,
        champion_success=gate.champion_success,
        updates=trained.updates,
        train_seconds=trained.train_seconds,
        completions_per_s=trained.completions_per_s,
        adapter_dir=trained.adapter_dir,
        checkpoint_path=trained.checkpoint_path,
    )


def summarise_adapter(
    run: Any, gate: GateDecision, base_model: str, evaluation: LLMEvaluation, completions_per_s: float, updates: int
) -> None:
    """An adapter's run closes with its version, aliases, base model and gate decision (this flow, a server job)."""
    run.summarise(
        tags={
            "opentinker.model_version": gate.version,
            "opentinker.aliases": ",".join(gate.aliases),
            "opentinker.base_model": base_model,
            "gate.decision": gate.decision,
        },
        metrics={"heldout/success_rate": evaluation.success, "train/completions_per_s_overall": completions_per_s},
        step=updates,
    )
