"""``trainer.train(steps, track=True)`` for SDK users: the run skeleton of ``train_flow`` (``tasks.run.tracked_run``)
and its stages called as plain functions, so the MLflow run has the flow's layout (params, per-iteration metrics,
plots, config, model card, checkpoint, registered model) and a notebook needs no Prefect server."""

from __future__ import annotations

import dataclasses
from typing import Any


def trainer_spec(trainer: Any, steps: int, **fields: Any) -> Any:
    """The run an SDK trainer is about to train, as a resolved ``RunSpec`` (every engine field is the trainer's), so
    the logged params read as a flow run's do. ``fields``: run fields (``run_name``, ``eval_episodes``, ...)."""
    from opentinker.tasks.spec import MEMBERS, RunSpec

    env = trainer.env
    engine = MEMBERS[trainer.algorithm].of(
        trainer.config, backend=env.backend, workers=env.num_workers if env.backend == "ray" else None
    )
    return RunSpec(env_id=trainer.env_id, steps=steps, seed=trainer.seed, engine=engine, resolved=True, **fields)


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
    from opentinker.tasks.register import register_model
    from opentinker.tasks.run import as_step, tracked_run
    from opentinker.tasks.train import spec_dir, train_logged
    from opentinker.tasks.upload import render_reports, upload_artifacts

    spec = trainer_spec(
        trainer,
        steps,
        run_name=run_name,
        model_name=model_name,
        experiment=experiment,
        eval_episodes=eval_episodes,
        eval_seed=eval_seed,
        checkpoint_every=checkpoint_every,
    )
    config = spec.config_form()
    with tracked_run(config, spec.resolved_run_name, spec.experiment) as run:
        trainer.last_run_id = run.run_id
        root = spec_dir(spec)
        trained = train_logged(
            trainer, run.run_id, steps, root, checkpoint_every, callback, metadata={"env_id": trainer.env_id}
        )
        evaluation = dataclasses.replace(trainer.evaluate(eval_episodes, eval_seed), model_key=f"run/{run.run_id}")
        model = as_step(register_model)(run.run_id, trained.export_dir, spec.resolved_model_name, evaluation)
        reports = as_step(render_reports)(config, trained, evaluation, model)
        as_step(upload_artifacts)(run.run_id, reports, trained.checkpoint_path, spec.resolved_run_name)
        run.summarise(
            tags={"opentinker.model_version": model.version, "opentinker.aliases": ",".join(model.aliases)},
            metrics={"eval/mean_return": evaluation.mean, "eval/std_return": evaluation.std},
            step=trained.global_step,
        )
    return {"eval/mean_return": evaluation.mean, "eval/std_return": evaluation.std}
