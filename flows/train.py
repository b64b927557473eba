"""The training flow: storage check → tracking run → Ray start → probe → train → evaluate → package → gate → reports.

No ``from __future__ import annotations`` in flow modules: Prefect builds a pydantic model from the flow's
signature to validate deployment parameters, and string annotations leave it "not fully defined".
"""
import opentinker.tasks  # noqa: F401  (Prefect defaults first)
from prefect import flow

from opentinker.flows.params import TrainFlowResult, TrainParams
from opentinker.flows.release import release_flow
from opentinker.infra.settings import get_settings
from opentinker.tasks.evaluate import evaluate_policy, resolve_model
from opentinker.tasks.package import package_model
from opentinker.tasks.rollout import collect_rollouts, start_ray
from opentinker.tasks.run import finish_tracking_run, publish_summary, start_tracking_run
from opentinker.tasks.train import run_dir, train_policy
from opentinker.tasks.upload import check_storage, render_reports, upload_artifacts


@flow(name="train", log_prints=True)
def train_flow(params: TrainParams) -> TrainFlowResult:
    """Train, evaluate, register and (maybe) promote one policy; one MLflow run per flow run."""
    check_storage()
    config = params.model_dump()
    tracking = start_tracking_run(config, params.resolved_run_name, params.experiment)
    try:
        start_ray()
        collect_rollouts(params.env_id, params.seed, params.num_envs, params.workers, run_id=tracking.run_id,
                         rollout_num_cpus=params.rollout_num_cpus, rollout_num_gpus=params.rollout_num_gpus)
        trained = train_policy(
            tracking.run_id,
            params.env_id,
            params.steps,
            params.seed,
            str(run_dir(get_settings().resolved_data_dir, params.resolved_run_name)),
            num_envs=params.num_envs,
            workers=params.workers,
            ppo=params.ppo,
            num_gpus=params.num_gpus,
            rollout_num_cpus=params.rollout_num_cpus,
            rollout_num_gpus=params.rollout_num_gpus,
            resume=params.resume,
            checkpoint_every=params.checkpoint_every,
        )
        evaluation = evaluate_policy(resolve_model(trained.export_dir, params.env_id), params.eval_episodes, params.eval_seed)
        candidate = package_model(tracking.run_id, trained.export_dir, params.resolved_model_name, evaluation,
                                  step=trained.global_step)
        released = release_flow(
            params.resolved_model_name,
            candidate.version,
            threshold=params.champion_threshold,
            candidate_eval=evaluation,
        )
        reports = render_reports(config, trained, evaluation, released)
        uris = upload_artifacts(tracking.run_id, reports, trained.checkpoint_path, params.resolved_run_name)
        publish_summary(tracking, released, evaluation)
    except BaseException:
        finish_tracking_run(tracking.run_id, status="FAILED")
        raise
    finish_tracking_run(
        tracking.run_id,
        tags={"opentinker.model_version": released.version, "opentinker.aliases": ",".join(released.aliases)},
        metrics={"eval/mean_return": evaluation.mean, "eval/std_return": evaluation.std},
        step=trained.global_step,
        model_id=candidate.model_id,
    )
    return TrainFlowResult(
        run_id=tracking.run_id,
        run_url=tracking.url,
        experiment_id=tracking.experiment_id,
        model_name=released.name,
        model_version=released.version,
        aliases=released.aliases,
        decision=released.decision,
        eval_mean=evaluation.mean,
        eval_std=evaluation.std,
        passed_threshold=evaluation.mean >= params.champion_threshold,
        global_step=trained.global_step,
        start_step=trained.start_step,
        train_seconds=trained.train_seconds,
        checkpoint_path=trained.checkpoint_path,
        artifact_uris=uris,
    )
