"""The training stage: one Prefect task running the RL core's whole loop (env copies in-process or on Ray actors).

Why one task and not one per iteration: a Prefect task run costs tens of milliseconds of API
round-trips and state bookkeeping, while a CartPole PPO iteration is ~0.1–0.3 s; per-iteration
tasks would cost far more than the 15 % overhead budget. Per-iteration visibility comes from the
RL core's callback instead (metrics to MLflow in batches, progress to the CLI); crash safety from
the RL core's atomic checkpoints (``resume=True`` continues from the last one); worker death is
handled inside the iteration by Ray (actor restarts, rollouts reseeded by (seed, iteration, worker)).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict, PrivateAttr

from opentinker.agents.build import build_trainer, env_copies, run_loop
from opentinker.infra.files import atomic_write
from opentinker.tasks.spec import RunSpec
from opentinker.tasks.training_process import TrainingProcess, spec_dir
from opentinker.tasks.training_process import run_dir as run_dir  # where the pipeline's callers look for it
from opentinker.tasks.types import TrainOutcome
from opentinker.tracking.runs import MetricsLogger, configure_mlflow


def run_log() -> logging.Logger | logging.LoggerAdapter:
    """Prefect's run logger inside a flow or task run (its lines reach the server's Logs tab), else a plain logger:
    the SDK's ``train(track=True)`` and training started ahead of its flow run have no run context."""
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("opentinker")


@task(cache_policy=NO_CACHE)
def train_policy(run_id: str, spec: RunSpec, early: EarlyTraining | None = None) -> TrainOutcome:
    """Train ``spec``'s policy (its engine config, resolved) until ``spec.steps`` global env steps; checkpoint,
    export, log every iteration. ``early``: the same spec's training already under way (adopted, not restarted).

    ``backend`` "local" steps the env copies in this process (gymnasium's vectorised implementation when the env has
    one: the RL core's fastest path for cheap envs); "ray" on rollout actors, whose Ray node ids are logged as run tags
    at the start and at the end (they differ when a node was replaced). The trainer rewrites
    ``checkpoints/checkpoint.pt`` atomically every ``checkpoint_every`` env steps and at the end; with ``resume``
    training continues from it (a finished run just re-exports). The learner trains on the GPU Ray grants for
    ``num_gpus`` (``learner_device``).
    """
    import mlflow
    from mlflow.entities import RunTag

    from opentinker.infra.ray_runtime import failing_without_rollout_nodes, learner_device, rollout_actor_options
    from opentinker.tasks import fork_server
    from opentinker.tracking.runs import log_capacity_wait

    root = spec_dir(spec)
    configure_mlflow()
    client = mlflow.MlflowClient()
    if early is not None and early.spec == spec and early.unadopted():
        start = "warm" if early.forked() else "fresh"  # forked from the data dir's warm process, or an interpreter
        tags = {"opentinker.rollout_nodes": "local", "opentinker.training_start": start}
        tags["opentinker.flow_start"] = "warm" if fork_server.FORKED else "fresh"  # this process: the same question
        client.log_batch(run_id, tags=[RunTag(key, value) for key, value in tags.items()])
        _write_json(root / "workers.json", {"pids": [early.pid], "nodes": ["local"]})
        return early.adopt(run_id)
    if early is not None:  # another run's: stop it, train this one
        early.cancel()
    config = spec.engine.config()
    with learner_device(spec.num_gpus) as device:  # first: a missing GPU fails before any actor starts
        ray = config.backend == "ray"
        options = rollout_actor_options(spec.rollout_num_cpus, spec.rollout_num_gpus) if ray else None
        placing = time.perf_counter()
        env = env_copies(spec.env_id, spec.seed, config, options)
        try:
            nodes = [node or "local" for node in env.worker_node_ids()]
            _write_json(root / "workers.json", {"pids": env.worker_pids(), "nodes": nodes})
            client.set_tag(run_id, "opentinker.rollout_nodes", ",".join(nodes))
            if options:  # nodes used, and the wait for capacity (autoscaler launches included)
                client.log_metric(run_id, "perf/rollout_nodes", len(set(nodes)))
                log_capacity_wait(client, run_id, time.perf_counter() - placing)
            with failing_without_rollout_nodes(options, env.close) if options else contextlib.nullcontext():
                trainer = build_trainer(env, spec.algorithm, config, spec.seed, root, device, spec.resume)
                outcome = train_logged(
                    trainer, run_id, spec.steps, root, spec.checkpoint_every, metadata=metadata(spec)
                )
            client.set_tag(
                run_id, "opentinker.rollout_nodes_final", ",".join(node or "local" for node in env.worker_node_ids())
            )
            return outcome
        finally:
            env.close()


def metadata(spec: RunSpec) -> dict[str, Any]:
    """What the export records about the run beside its own spec (how evaluation rebuilds the env)."""
    return {"env_id": spec.env_id}


def train_logged(
    trainer: Any,
    run_id: str,
    steps: int,
    root: Path,
    checkpoint_every: int | None = None,
    callback: Any = None,
    metadata: dict[str, Any] | None = None,
) -> TrainOutcome:
    """Train an RL-core trainer with metrics to the MLflow run ``run_id`` (and progress listeners), checkpoints under
    ``root/checkpoints``, then the export and the history; the flow's training stage and the SDK's
    ``train(track=True)`` both run this. ``callback`` (the SDK user's) runs after the logger; False stops."""
    from opentinker.agents.checkpoint import CHECKPOINT_NAME
    from opentinker.agents.export import export_policy

    logger = MetricsLogger.with_progress(run_id, steps)

    def log_then_call(metrics: dict[str, float], step: int) -> bool | None:
        logger(metrics, step)
        return None if callback is None else callback(metrics, step)

    start_step = int(trainer.global_step)
    seconds = run_loop(trainer, steps, root, checkpoint_every, log_then_call)
    export_dir = export_policy(trainer, root / "export", metadata={**(metadata or {}), "run_id": run_id})
    checkpoint = root / "checkpoints" / CHECKPOINT_NAME
    pids = trainer.env.worker_pids()
    return _finish(logger, root, start_step, int(trainer.global_step), seconds, export_dir, checkpoint, pids)


def _finish(
    logger: MetricsLogger,
    root: Path,
    start_step: int,
    global_step: int,
    train_seconds: float,
    export_dir: str | Path,
    checkpoint_path: str | Path,
    worker_pids: list[int],
) -> TrainOutcome:
    """Flush the metrics, tag the dashboard remedies, append the history: what follows every training loop.
    Paths come from the caller: this process may not hold the trainer (it trained in a child), and importing the RL
    core's checkpoint module just for a file name would import torch here (2 s of a small run's wrap-up)."""
    import mlflow

    from opentinker.tracking.remedies import dashboard_remedies

    logger.flush()
    run_log().info("trained to env step %d in %.1f s (%d iterations)", global_step, train_seconds, len(logger.history))
    remedies = dashboard_remedies(logger.history)
    mlflow.MlflowClient().set_tag(logger.run_id, "opentinker.dashboard_remedies", "; ".join(remedies) or "none")
    history = logger.save_history(root / "history.jsonl")
    return TrainOutcome(
        run_id=logger.run_id,
        checkpoint_path=str(checkpoint_path),
        export_dir=str(export_dir),
        history_path=str(history),
        start_step=start_step,
        global_step=global_step,
        iterations=len(logger.history),
        train_seconds=train_seconds,
        worker_pids=worker_pids,
    )


class EarlyTraining(BaseModel):
    """Training started before its flow run (``start``), handed to the flow and by the flow to ``train_policy``,
    which adopts it: attaches its MLflow run and waits for it. The seconds of fixed work ahead of training (Prefect's
    API server, the MLflow run, the probe) need not come first. It trains in its own process (``TrainingProcess``:
    the flow's start-up would otherwise slow its loop); its metrics wait in this one until the run is attached.
    Only for env copies in-process and a CPU learner (no Ray resources to hold).

    A pydantic model so that Prefect records the handle as a flow-run parameter (the spec, the child's pid)."""

    model_config = ConfigDict(frozen=True)

    spec: RunSpec
    pid: int
    _process: TrainingProcess = PrivateAttr()
    _logger: MetricsLogger = PrivateAttr()
    _adopted: bool = PrivateAttr(False)

    @classmethod
    def attach(cls, spec: RunSpec, process: TrainingProcess) -> EarlyTraining:
        """The handle on ``process``, the child training ``spec`` (``training_process.start_early``): its metrics
        now go to the run's logger and the progress bar; ``cancel()`` it if the flow never adopts it."""
        early = cls(spec=spec, pid=process.pid)
        early._process = process
        early._logger = MetricsLogger.with_progress(None, spec.steps, learner_pid=process.pid)
        process.report_to(early._logger)
        return early

    def forked(self) -> bool:
        """Whether the child is a fork of the data dir's warm process (``tasks.fork_server``)."""
        return self._process.forked

    def unadopted(self) -> bool:
        """Whether no training task has adopted it yet: a flow retry (Prefect's, after a failure) trains anew from the
        run's last checkpoint instead of adopting the same, finished, child again."""
        return not self._adopted

    def adopt(self, run_id: str) -> TrainOutcome:
        """Attach the MLflow run, wait for the loop and the export, then finish like ``train_logged``."""
        self._adopted = True
        self._logger.run_id = run_id
        done = self._process.finish(run_id)
        return _finish(
            self._logger,
            spec_dir(self.spec),
            done["start_step"],
            done["global_step"],
            done["seconds"],
            done["export_dir"],
            done["checkpoint_path"],
            [self.pid],
        )

    def cancel(self) -> None:
        """Stop after the current iteration (the flow failed before adopting it); nothing once adopted."""
        self._process.cancel()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomic: ops tools (and the kill-a-worker test) read it while training runs."""
    atomic_write(path, json.dumps(data))
