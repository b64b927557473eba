"""A group run (``engine.algorithm == "group"``) inside ``train_flow``: train the agent kinds together → evaluate
each kind → one registered model per kind."""

from __future__ import annotations

import dataclasses

from pydantic import BaseModel

from opentinker.agents.evaluation import EvalResult
from opentinker.tasks.multiagent import evaluate_group, train_group
from opentinker.tasks.register import register_model
from opentinker.tasks.run import tracked_run
from opentinker.tasks.spec import RunSpec
from opentinker.tracking.registry import ModelRef


class GroupFlowResult(BaseModel):
    run_id: str
    run_url: str
    global_step: int
    checkpoint_path: str
    evaluation: dict[str, EvalResult]
    models: dict[str, ModelRef]
    """Kind -> its registered model (``<model_name>-<kind>``, alias ``candidate``)."""


def group_run(spec: RunSpec) -> GroupFlowResult:
    """Train all kinds together, evaluate them, register one MLflow model per kind (alias ``candidate``)."""
    with tracked_run(spec.config_form(), spec.resolved_run_name, spec.experiment) as run:
        trained = train_group(run.run_id, spec)
        evaluation = evaluate_group(trained.checkpoint_path, spec.eval_episodes, spec.eval_seed)
        models = {
            kind: register_model(
                run.run_id,
                trained.export_dirs[kind],
                f"{spec.resolved_model_name}-{kind}",
                dataclasses.replace(result, model_key=f"{run.run_id}/{kind}"),
            )
            for kind, result in evaluation.items()
        }
        run.summarise(
            metrics={
                f"eval/{kind}/{name}": getattr(result, name)
                for kind, result in evaluation.items()
                for name in ("mean", "std", "mean_length", "terminated_fraction")
            },
            step=trained.global_step,
            tags={f"opentinker.model.{kind}": f"{ref.name}/{ref.version}" for kind, ref in models.items()},
        )
    return GroupFlowResult(
        run_id=run.run_id,
        run_url=run.tracking.url,
        global_step=trained.global_step,
        checkpoint_path=trained.checkpoint_path,
        evaluation=evaluation,
        models=models,
    )
