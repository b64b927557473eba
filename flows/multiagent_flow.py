"""Multi-agent training flow: tracking run → train the group → evaluate each kind → one registered model per kind."""

from __future__ import annotations

import dataclasses

from prefect import flow
from pydantic import BaseModel

from opentinker.agents.evaluation import EvalResult
from opentinker.flows.params import MultiAgentParams
from opentinker.infra.settings import get_settings
from opentinker.tasks.multiagent import evaluate_group, train_group
from opentinker.tasks.register import register_model
from opentinker.tasks.run import finish_tracking_run, start_tracking_run
from opentinker.tasks.train import run_dir
from opentinker.tracking.registry import ModelRef


class MultiAgentFlowResult(BaseModel):
    run_id: str
    run_url: str
    global_step: int
    evaluation: dict[str, EvalResult]
    models: dict[str, ModelRef]


@flow(name="multiagent-train", log_prints=True)
def multiagent_train_flow(params: MultiAgentParams) -> MultiAgentFlowResult:
    """Train all kinds together, evaluate them, register one MLflow model per kind (alias ``candidate``)."""
    config = {**params.model_dump(), "algorithm": "+".join(f"{k}:{a}" for k, a in params.policy_mapping.items())}
    tracking = start_tracking_run(config, params.run_name, params.experiment)
    try:
        trained = train_group(
            tracking.run_id,
            str(run_dir(get_settings().resolved_data_dir, params.run_name)),
            params.policy_mapping,
            params.configs,
            params.steps,
            seed=params.seed,
            env_id=params.env_id,
            env_kwargs=params.env_kwargs,
            shared_memory=params.shared_memory,
            num_envs=params.num_envs,
            n_steps=params.n_steps,
            resume=params.resume,
            checkpoint_every=params.checkpoint_every,
            backend=params.backend,
            workers=params.workers,
        )
        evaluation = evaluate_group(trained.checkpoint_path, params.eval_episodes, params.eval_seed)
        models = {
            kind: register_model(
                tracking.run_id,
                trained.export_dirs[kind],
                f"{params.model_name}-{kind}",
                dataclasses.replace(result, model_key=f"{tracking.run_id}/{kind}"),
            )
            for kind, result in evaluation.items()
        }
    except BaseException:
        finish_tracking_run(tracking.run_id, status="FAILED")
        raise
    metrics = {
        f"eval/{kind}/{name}": getattr(result, name)
        for kind, result in evaluation.items()
        for name in ("mean", "std", "mean_length", "terminated_fraction")
    }
    finish_tracking_run(
        tracking.run_id,
        metrics=metrics,
        step=trained.global_step,
        tags={f"opentinker.model.{kind}": f"{ref.name}/{ref.version}" for kind, ref in models.items()},
    )
    return MultiAgentFlowResult(
        run_id=tracking.run_id,
        run_url=tracking.url,
        global_step=trained.global_step,
        evaluation=evaluation,
        models=models,
    )
