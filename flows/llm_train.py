"""GRPO through the pipeline: probe the text task → tracking run → train (Ray rollouts) → evaluate held-out →
register the adapter → champion gate. ``opentinker train TASK --algo grpo`` runs it.

No ``from __future__ import annotations`` (Prefect builds a pydantic model from the flow's signature).
"""

from pathlib import Path
from typing import Any, Literal

from prefect import flow
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from opentinker.infra.settings import get_settings
from opentinker.tasks.llm import (
    GateDecision,
    LLMEvaluation,
    evaluate_adapter,
    gate_adapter,
    probe_text_task,
    register_adapter,
    train_grpo,
)
from opentinker.tasks.run import finish_tracking_run, start_tracking_run
from opentinker.tasks.train import run_dir
from opentinker.tracking.registry import slug


class GRPOParams(BaseModel):
    """One GRPO training run of the agent's language model on a shipped text task."""

    model_config = ConfigDict(extra="forbid")

    task: str = Field("arithmetic", description="Shipped text task (envs.text_tasks.TEXT_TASKS).")
    algorithm: Literal["grpo"] = "grpo"
    steps: int = Field(50, gt=0, description="Optimiser steps (each: prompts_per_step x group_size completions).")
    seed: int = Field(0, ge=0, description="Seeds the adapter, the prompt order and every rollout (seed, step, group).")
    workers: int = Field(2, gt=0, description="Rollout actors.")
    backend: Literal["ray", "local"] = Field("ray", description="'ray' actors or in-process workers.")
    grpo: dict[str, Any] = Field(default_factory=dict, description="Overrides of agents.grpo.GRPOConfig fields.")
    eval_every: int | None = Field(None, gt=0, description="Steps between held-out evaluations (learning curve).")
    checkpoint_every: int | None = Field(None, gt=0)
    resume: bool = False
    run_name: str | None = None
    model_name: str | None = None
    champion_threshold: float = Field(0.0, ge=0, le=1, description="Held-out success a candidate needs for champion.")
    experiment: str | None = None

    @field_validator("grpo")
    @classmethod
    def _known_fields(cls, grpo: dict[str, Any]) -> dict[str, Any]:
        from opentinker.agents.grpo import grpo_config

        if "task" in grpo:  # one place per field: the top-level task is what runs
            raise ValueError("grpo.task: set it at the top level (task = ...), not in the [grpo] table")
        grpo_config(grpo)  # unknown field or bad value: named here, before any service starts
        return grpo

    @field_validator("task")
    @classmethod
    def _known_task(cls, task: str) -> str:
        from opentinker.envs.text_tasks import text_task

        text_task(task)
        return task

    @property
    def config(self) -> dict[str, Any]:
        return {"task": self.task, **self.grpo}

    @property
    def resolved_run_name(self) -> str:
        return self.run_name or f"{slug(self.task)}-grpo-seed{self.seed}"

    @property
    def resolved_model_name(self) -> str:
        return self.model_name or f"opentinker-{slug(self.task)}-agent"


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
    global_step: int
    train_seconds: float
    completions_per_s: float
    adapter_dir: str
    checkpoint_path: str


def load_grpo_params(config_file: Path | None = None, **overrides: Any) -> GRPOParams:
    """A config file (TOML/JSON of GRPOParams fields) plus CLI overrides; errors name the field."""
    from opentinker.flows.params import ConfigError, _read_config, describe_errors

    data = _read_config(config_file) if config_file is not None else {}
    data.update({key: value for key, value in overrides.items() if value is not None})
    try:
        return GRPOParams(**data)
    except ValidationError as exc:
        source = f" in {config_file}" if config_file else ""
        raise ConfigError(f"invalid GRPO config{source}:\n" + describe_errors(exc)) from None


@flow(name="grpo-train", log_prints=True)
def grpo_train_flow(params: GRPOParams) -> GRPOFlowResult:
    """Train, evaluate, register and (maybe) promote one LoRA adapter; one MLflow run per flow run."""
    from opentinker.agents.grpo import grpo_config

    config = grpo_config(params.config)
    probe_text_task(params.task, config.task_seed)
    tracking = start_tracking_run(
        {**params.model_dump(), "env_id": params.task, "grpo": vars(config)},
        params.resolved_run_name,
        params.experiment,
    )
    try:
        trained = train_grpo(
            tracking.run_id,
            str(run_dir(get_settings().resolved_data_dir, params.resolved_run_name)),
            params.config,
            params.steps,
            seed=params.seed,
            workers=params.workers,
            backend=params.backend,
            resume=params.resume,
            checkpoint_every=params.checkpoint_every,
            eval_every=params.eval_every,
        )
        evaluation = evaluate_adapter(
            trained.adapter_dir,
            config.eval_prompts,
            config.eval_batch,
            config.cache_dir,
            run_id=tracking.run_id,
            step=trained.global_step,
        )
        version = register_adapter(
            tracking.run_id, trained.adapter_dir, params.resolved_model_name, config.base_model, params.task
        )
        gate: GateDecision = gate_adapter(
            params.resolved_model_name,
            version,
            evaluation,
            params.champion_threshold,
            config.eval_batch,
            config.cache_dir,
        )
    except BaseException:
        finish_tracking_run(tracking.run_id, status="FAILED")
        raise
    finish_tracking_run(
        tracking.run_id,
        tags={
            "opentinker.model_version": version,
            "opentinker.aliases": ",".join(gate.aliases),
            "opentinker.base_model": config.base_model,
        },
        metrics={
            "heldout/success_rate": evaluation.success,
            "train/completions_per_s_overall": trained.completions_per_s,
        },
        step=trained.global_step,
    )
    return GRPOFlowResult(
        run_id=tracking.run_id,
        run_url=tracking.url,
        model_name=params.resolved_model_name,
        model_version=version,
        aliases=gate.aliases,
        decision=gate.decision,
        base_eval=trained.base_eval,
        evaluation=evaluation,
        champion_success=gate.champion_success,
        global_step=trained.global_step,
        train_seconds=trained.train_seconds,
        completions_per_s=trained.completions_per_s,
        adapter_dir=trained.adapter_dir,
        checkpoint_path=trained.checkpoint_path,
    )
