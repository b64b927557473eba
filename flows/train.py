"""The training flow, one for every algorithm: ``train_flow(spec)`` resolves the spec once, then runs the run of its
algorithm in this one flow run — a policy (PPO, DQN, ...: storage check → tracking run → Ray start → probe → train →
evaluate → register → gate → reports), a GRPO adapter (``flows/grpo.py``) or an agent group (``flows/group.py``).

No ``from __future__ import annotations`` in flow modules: Prefect builds a pydantic model from the flow's
signature to validate deployment parameters, and string annotations leave it "not fully defined".
"""

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

from prefect import flow

from opentinker.agents.evaluation import choose_served
from opentinker.flows.group import GroupFlowResult, group_run
from opentinker.flows.grpo import GRPOFlowResult, grpo_run
from opentinker.flows.params import TrainFlowResult
from opentinker.flows.presets import resolve_spec
from opentinker.flows.release import release_flow
from opentinker.tasks.evaluate import evaluate_policy, resolve_model
from opentinker.tasks.probe import probe_env, start_ray
from opentinker.tasks.register import register_model
from opentinker.tasks.run import publish_summary, tracked_run
from opentinker.tasks.spec import RunSpec
from opentinker.tasks.train import EarlyTraining, train_policy
from opentinker.tasks.training_process import TrainingProcess, start_early
from opentinker.tasks.upload import check_storage, render_reports, reports_dir, upload_artifacts
from opentinker.tracking.plot_process import PlotProcess


@flow(name="train", log_prints=True)
def train_flow(spec: RunSpec, early: EarlyTraining | None = None) -> TrainFlowResult | GRPOFlowResult | GroupFlowResult:
    """One training run of ``spec`` (any algorithm); one MLflow run per flow run.

    The spec is resolved first (``presets.resolve_spec``; once: a resolved spec stays as it is), so the run's params
    are what it trained with. ``early``: this spec's training already under way (``run_train_flow``).
    """
    check_storage()
    spec = resolve_spec(spec)
    if spec.algorithm == "grpo":
        return grpo_run(spec)
    if spec.algorithm == "group":
        return group_run(spec)
    return policy_run(spec, early)


def policy_run(spec: RunSpec, early: EarlyTraining | None = None) -> TrainFlowResult:
    """Train, evaluate, register and (maybe) promote one policy."""
    config = spec.config_form()
    with tracked_run(config, spec.resolved_run_name, spec.experiment) as run:
        if spec.engine.backend == "ray":
            start_ray()  # its own step: Ray's start-up shows in the UI, not inside the probe
        probe_env(spec, run_id=run.run_id)
        # The plots draw in a process of their own while the model registers (on the core training leaves); it
        # imports matplotlib while training ends.
        with PlotProcess() as drawing:
            trained = train_policy(run.run_id, spec, early)
            evaluated = evaluate_policy(
                resolve_model(trained.export_dir), spec.env_id, spec.eval_episodes, spec.eval_seed
            )
            evaluation = choose_served(evaluated)  # what the model will serve, recorded with it at registration
            drawing.draw(trained.history_path, reports_dir(trained), evaluation)
            candidate = register_model(
                run.run_id, trained.export_dir, spec.resolved_model_name, evaluation, step=trained.global_step
            )
            # The gate's body, not a subflow run: its tasks become this run's (the Task Runs tab lists them), and a
            # subflow run's API round-trips and heartbeat-thread join cost a second and more of every training run.
            released = release_flow.fn(
                spec.resolved_model_name,
                candidate.version,
                threshold=spec.champion_threshold,
                candidate_eval=evaluation,
            )
            uris = publish_policy(spec, run, trained, evaluation, released, candidate.model_id, drawing)
    threshold = spec.champion_threshold
    return TrainFlowResult(
        run_id=run.run_id,
        run_url=run.tracking.url,
        experiment_id=run.tracking.experiment_id,
        model_name=released.name,
        model_version=released.version,
        aliases=released.aliases,
        decision=released.decision,
        eval_mean=evaluation.mean,
        eval_std=evaluation.std,
        eval_action=evaluation.action,
        eval_greedy_mean=evaluation.mean_of("greedy"),
        eval_sampled_mean=evaluation.mean_of("sampled"),
        threshold=threshold,
        passed_threshold=released.decision.startswith("promoted")
        if threshold is None
        else evaluation.mean >= threshold,
        global_step=trained.global_step,
        start_step=trained.start_step,
        train_seconds=trained.train_seconds,
        checkpoint_path=trained.checkpoint_path,
        artifact_uris=uris,
    )


def publish_policy(
    spec: RunSpec,
    run: Any,
    trained: Any,
    evaluation: Any,
    released: Any,
    model_id: str | None,
    drawing: PlotProcess | None = None,
) -> list[str]:
    """What closes a policy's run once its gate decided, wherever it trained (this flow, a server job's attempt):
    reports and checkpoint as artifacts, the Prefect summary, the run's final tags and metrics. The artifacts' URIs.
    ``drawing``: the run's plots already being drawn (``render_reports``)."""
    reports = render_reports(spec.config_form(), trained, evaluation, released, drawing)
    uris = upload_artifacts(run.run_id, reports, trained.checkpoint_path, spec.resolved_run_name)
    publish_summary(run.tracking, released, evaluation)
    run.summarise(
        tags={"opentinker.model_version": released.version, "opentinker.aliases": ",".join(released.aliases)},
        metrics={"eval/mean_return": evaluation.mean, "eval/std_return": evaluation.std},
        step=trained.global_step,
        model_id=model_id,
    )
    return uris


def run_train_flow(
    spec: RunSpec, training: TrainingProcess | None = None
) -> TrainFlowResult | GRPOFlowResult | GroupFlowResult:
    """What ``opentinker train`` and ``quickstart`` run: ``train_flow`` on the resolved spec, with a policy's
    training already under way in its own process (env copies in-process, CPU learner) while Prefect's API server
    starts, since none of that start-up has to come first; the flow's training task adopts it. ``training``: that
    process, started by the caller before it imported this module (``training_process.start_early``, the CLI);
    else it starts here. Other runs start training inside the flow as usual. This process prepares the run's later
    stages meanwhile (``prepare_stages``)."""
    spec = resolve_spec(spec)
    training = training or start_early(spec)
    early = None if training is None else EarlyTraining.attach(spec, training)
    try:
        with prefect_api_starting() as local_api:
            prepare_stages(spec.experiment)
        with without_heartbeats() if local_api else contextlib.nullcontext():
            return train_flow(spec, early)
    finally:
        if training is not None:  # the flow failed before its training task adopted it (else: nothing to do)
            training.cancel()


@contextlib.contextmanager
def prefect_api_starting() -> Iterator[list[str]]:
    """With no Prefect API configured, the data dir's own Prefect server (``infra.local_prefect``: adopted when a
    previous run left it running, else started and kept for the next) is found or started from a thread while the
    block runs, then becomes this process's API. Starting is a process of its own that this one only polls, so the
    block's work overlaps it. A server that failed to start leaves Prefect's temporary one to the flow's client,
    which starts it and reports what fails. Yields a list that holds, after the block, the API URL of the data dir's
    server when this process now uses it (empty otherwise)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE

    found: list[str] = []
    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
        yield found
        return
    from opentinker.infra.local_prefect import ensure_local_prefect

    def start() -> None:
        try:
            found.append(f"{ensure_local_prefect().url}/api")
        except Exception as exc:  # the temporary server still runs the flow
            logging.getLogger("opentinker").warning("no local Prefect server (%s); using a temporary one", exc)

    thread = threading.Thread(target=start, name="prefect-api-start", daemon=True)
    thread.start()
    try:
        yield found
    finally:
        thread.join()
    if found:
        from opentinker.tasks import prefect_defaults

        os.environ["PREFECT_API_URL"] = found[0]  # for this process's every thread, as a configured API would be
        prefect_defaults()  # Prefect re-reads its settings


def without_heartbeats() -> contextlib.AbstractContextManager:
    """Prefect's flow-run heartbeats off, for a run on the data dir's own server: nothing there reads them (Prefect
    marks no run crashed without an automation; the server's jobs, which have one, keep theirs: ``HEARTBEAT_S``),
    and the flow run's end joins their thread, which sleeps in 1 s steps: 0-1 s at the end of every small run."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    return temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


def prepare_stages(experiment: str | None) -> None:
    """What the run's stages would otherwise load one after the other on this process's critical path: the MLflow
    store (a new SQLite store's migrations, an existing one's schema check; MLflow keeps it per process) with the
    run's experiment, MLflow's model flavours, the map of installed packages that logging a model checks its
    requirements against (registration; MLflow reads every installed distribution's metadata for it, 0.7-1.3 s) and
    the source tags a logged model records (MLflow imports GitPython to read the command's git commit: 0.1-0.3 s).
    Only ahead of time: a store that fails here fails again in the flow's own step, which retries and reports it.
    (matplotlib is the plotting process's: ``PlotProcess``.)"""
    import mlflow.pyfunc  # noqa: F401

    from opentinker.tracking.runs import ensure_experiment

    with contextlib.suppress(Exception):
        ensure_experiment(experiment)
    with contextlib.suppress(Exception):  # MLflow's own per-process caches; without them, registration fills them
        from mlflow.tracking.context.registry import resolve_tags
        from mlflow.utils.requirements_utils import _init_packages_to_modules_map

        _init_packages_to_modules_map()
        resolve_tags()
