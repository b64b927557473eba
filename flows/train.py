"""The training flow: storage check → tracking run → Ray start → probe → train → evaluate → register → gate → reports.

No ``from __future__ import annotations`` in flow modules: Prefect builds a pydantic model from the flow's
signature to validate deployment parameters, and string annotations leave it "not fully defined".
"""

from prefect import flow

from opentinker.flows.params import TrainFlowResult, TrainParams
from opentinker.flows.presets import resolve_params
from opentinker.flows.release import release_flow
from opentinker.infra.settings import get_settings
from opentinker.tasks.evaluate import evaluate_policy, resolve_model
from opentinker.tasks.probe import probe_env, start_ray
from opentinker.tasks.register import register_model
from opentinker.tasks.run import finish_tracking_run, publish_summary, start_tracking_run
from opentinker.tasks.train import is_pending, run_dir, start_early, train_policy
from opentinker.tasks.upload import check_storage, render_reports, upload_artifacts


@flow(name="train", log_prints=True)
def train_flow(params: TrainParams) -> TrainFlowResult:
    """Train, evaluate, register and (maybe) promote one policy; one MLflow run per flow run.

    Defaults are made concrete first (``presets.resolve_params``), so the run's params are what it trained with.
    """
    check_storage()
    params = resolve_params(params)
    config = params.config_form()
    tracking = start_tracking_run(config, params.resolved_run_name, params.experiment)
    engine = params.engine
    try:
        if engine.backend == "ray":
            start_ray()  # its own step: Ray's start-up shows in the UI, not inside the probe
        probe_env(
            params.env_id,
            params.seed,
            engine.num_envs,
            engine.workers,
            run_id=tracking.run_id,
            rollout_num_cpus=params.rollout_num_cpus,
            rollout_num_gpus=params.rollout_num_gpus,
            backend=engine.backend,
        )
        trained = train_policy(
            tracking.run_id,
            params.env_id,
            params.steps,
            params.seed,
            str(run_dir(get_settings().resolved_data_dir, params.resolved_run_name)),
            engine.model_dump(exclude_none=True),
            num_gpus=params.num_gpus,
            rollout_num_cpus=params.rollout_num_cpus,
            rollout_num_gpus=params.rollout_num_gpus,
            resume=params.resume,
            checkpoint_every=params.checkpoint_every,
        )
        evaluation = evaluate_policy(
            resolve_model(trained.export_dir), params.env_id, params.eval_episodes, params.eval_seed
        )
        candidate = register_model(
            tracking.run_id, trained.export_dir, params.resolved_model_name, evaluation, step=trained.global_step
        )
        # The gate's body, not a subflow run: its tasks become this run's (the Task Runs tab lists them), and a
        # subflow run's API round-trips and heartbeat-thread join cost a second and more of every training run.
        released = release_flow.fn(
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
        threshold=params.champion_threshold,
        passed_threshold=released.decision.startswith("promoted")
        if params.champion_threshold is None
        else evaluation.mean >= params.champion_threshold,
        global_step=trained.global_step,
        start_step=trained.start_step,
        train_seconds=trained.train_seconds,
        checkpoint_path=trained.checkpoint_path,
        artifact_uris=uris,
    )


def run_train_flow(params: TrainParams) -> TrainFlowResult:
    """What ``opentinker train`` and ``quickstart`` run: ``train_flow``, with in-process training (env copies in this
    process, CPU learner) already under way while Prefect's API server starts, since none of that start-up has to come
    first; the flow's training task adopts it. Other runs start training inside the flow as usual."""
    resolved = resolve_params(params)
    early = None
    if resolved.engine.backend == "local" and resolved.num_gpus == 0:
        early = start_early(
            resolved.env_id,
            resolved.steps,
            resolved.seed,
            str(run_dir(get_settings().resolved_data_dir, resolved.resolved_run_name)),
            resolved.engine.model_dump(exclude_none=True),
            resolved.resume,
            resolved.checkpoint_every,
        )
    try:
        return train_flow(params)
    finally:
        if early is not None and is_pending(early):  # the flow failed before its training task
            early.cancel()
