"""``trainer.train(steps, track=True)`` for SDK users: the same MLflow run layout as ``train_flow`` (params, per-
iteration metrics, plots, config, model card, checkpoint, registered model), built from the flow's own stages
called as plain functions (``task.fn``), so a notebook needs no Prefect server."""

from __future__ import annotations

import dataclasses
from typing import Any


def _params(
    trainer: Any,
    steps: int,
    run_name: str | None,
    model_name: str | None,
    experiment: str | None,
    eval_episodes: int,
    eval_seed: int,
):
    """The run described as ``TrainParams``, so the logged params read as a flow run's do."""
    from opentinker.flows.params import TrainParams

    env = trainer.env
    engine = {
        **dataclasses.asdict(trainer.config),
        "algorithm": trainer.algorithm,
        "backend": env.backend,
        "workers": env.num_workers if env.backend == "ray" else None,
    }
    return TrainParams(
        env_id=trainer.env_id,
        steps=steps,
        seed=trainer.seed,
        engine=engine,
        run_name=run_name,
        model_name=model_name,
        experiment=experiment,
        eval_episodes=eval_episodes,
        eval_seed=eval_seed,
    )


def train_tracked(
    trainer: Any,
    steps: int,
    callback: Any = None,
    checkpoint_every: int | None = None,
    run_name: str | None = None,
    model_name: str | None = None,
    experiment: str | None = None,
    eval_episodes: int = 10,
    eval_seed: int = 10_000,
) -> dict[str, float]:
    """Train with tracking; evaluate, register the export as ``candidate`` of ``model_name``, upload the reports.

    Returns the evaluation (``eval/mean_return``, ``eval/std_return``); the run id is ``trainer.last_run_id``.
    """
    from opentinker.infra.settings import get_settings
    from opentinker.tasks.register import register_model
    from opentinker.tasks.run import finish_tracking_run, start_tracking_run
    from opentinker.tasks.train import run_dir, train_logged
    from opentinker.tasks.upload import render_reports, upload_artifacts

    params = _params(trainer, steps, run_name, model_name, experiment, eval_episodes, eval_seed)
    config = params.config_form()
    tracking = start_tracking_run.fn(config, params.resolved_run_name, params.experiment)
    trainer.last_run_id = tracking.run_id
    try:
        root = run_dir(get_settings().resolved_data_dir, params.resolved_run_name)
        trained = train_logged(
            trainer, tracking.run_id, steps, root, checkpoint_every, callback, metadata={"env_id": trainer.env_id}
        )
        evaluation = dataclasses.replace(trainer.evaluate(eval_episodes, eval_seed), model_key=f"run/{tracking.run_id}")
        model = register_model.fn(tracking.run_id, trained.export_dir, params.resolved_model_name, evaluation)
        reports = render_reports.fn(config, trained, evaluation, model)
        upload_artifacts.fn(tracking.run_id, reports, trained.checkpoint_path, params.resolved_run_name)
    except BaseException:
        finish_tracking_run.fn(tracking.run_id, status="FAILED")
        raise
    finish_tracking_run.fn(
        tracking.run_id,
        tags={"opentinker.model_version": model.version, "opentinker.aliases": ",".join(model.aliases)},
        metrics={"eval/mean_return": evaluation.mean, "eval/std_return": evaluation.std},
        step=trained.global_step,
    )
    return {"eval/mean_return": evaluation.mean, "eval/std_return": evaluation.std}
