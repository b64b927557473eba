"""The run skeleton every training entry shares (``tracked_run``: the train flow of each algorithm and the SDK's
``train(track=True)``): one MLflow run, opened before training with params and provenance tags, closed with a
status and a summary; and the Prefect artifacts that summarise a flow run."""

from __future__ import annotations

import contextlib
import getpass
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from opentinker.agents.evaluation import EvalResult
from opentinker.tasks.retry import io_task
from opentinker.tracking.registry import ModelRef
from opentinker.tracking.runs import (
    configure_mlflow,
    ensure_experiment,
    flatten,
    git_commit,
    run_url,
    start_system_metrics,
    stop_system_metrics,
    ui_url,
)


class TrackingRun(BaseModel):
    run_id: str
    experiment_id: str
    url: str


@dataclass
class TrackedRun:
    """The open run a ``tracked_run`` body works in; the body says what the run closes with (``summarise``)."""

    tracking: TrackingRun
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def run_id(self) -> str:
        return self.tracking.run_id

    def summarise(
        self,
        tags: dict[str, str] | None = None,
        metrics: dict[str, float] | None = None,
        step: int = 0,
        model_id: str | None = None,
    ) -> None:
        """Final tags and summary metrics (at the run's last step; linked to the logged model ``model_id``)."""
        self.summary = {"tags": tags, "metrics": metrics, "step": step, "model_id": model_id}


@contextlib.contextmanager
def tracked_run(params: dict[str, Any], run_name: str, experiment: str | None = None) -> Iterator[TrackedRun]:
    """Open the MLflow run (params, provenance tags, system metrics), run the body, then close the run FINISHED
    with the body's summary, or FAILED when the body raises (the error propagates). Inside a flow run each step is
    a task run; outside one (the SDK) a plain call, so a notebook needs no Prefect server."""
    tracking = as_step(start_tracking_run)(params, run_name, experiment)
    run = TrackedRun(tracking)
    try:
        yield run
    except BaseException:
        as_step(finish_tracking_run)(tracking.run_id, status="FAILED")
        raise
    as_step(finish_tracking_run)(tracking.run_id, **run.summary)


def as_step(task_: Any) -> Any:
    """The task inside a flow run (a task run of it), its plain function outside one."""
    from prefect.context import FlowRunContext

    return task_ if FlowRunContext.get() is not None else task_.fn


@io_task
def start_tracking_run(params: dict[str, Any], run_name: str, experiment: str | None = None) -> TrackingRun:
    """Create the MLflow run; tags link it to the Prefect flow run and the code that produced it."""
    import mlflow
    from prefect.runtime import flow_run

    experiment_id = ensure_experiment(experiment)
    client = mlflow.MlflowClient()
    prefect_link = f"[Prefect flow run]({flow_run.ui_url})" if flow_run.id and flow_run.ui_url else "Prefect local mode"
    tags = {
        "mlflow.runName": run_name,
        "mlflow.source.name": f"opentinker {flow_run.flow_name or 'train'} flow",
        "mlflow.source.type": "JOB",
        "mlflow.user": getpass.getuser(),
        "mlflow.note.content": f"{params.get('algorithm', 'ppo')} on `{params.get('env_id')}` for "
        f"{params.get('steps')} env steps · {prefect_link}",
        "mlflow.source.git.commit": git_commit(),
        "opentinker.env_id": str(params.get("env_id")),
        "opentinker.algorithm": str(params.get("algorithm", "ppo")),
        "prefect.flow_run_id": str(flow_run.id or ""),
        "prefect.flow_run_name": str(flow_run.name or ""),
    }
    run = client.create_run(experiment_id, run_name=run_name, tags=tags)
    from mlflow.entities import Param

    client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in flatten(params).items()])
    start_system_metrics(run.info.run_id)
    return TrackingRun(run_id=run.info.run_id, experiment_id=experiment_id, url=run_url(run.info.run_id, experiment_id))


@io_task
def finish_tracking_run(
    run_id: str,
    status: str = "FINISHED",
    tags: dict[str, str] | None = None,
    metrics: dict[str, float] | None = None,
    step: int = 0,
    model_id: str | None = None,
) -> None:
    """Final tags and summary metrics (evaluation, at the last global step), then close the run.

    With ``model_id`` the metrics are also linked to that logged model, so its page shows what it scores.
    """
    import mlflow

    configure_mlflow()
    client = mlflow.MlflowClient()
    for key, value in (tags or {}).items():
        client.set_tag(run_id, key, value)
    for key, value in (metrics or {}).items():
        client.log_metric(run_id, key, float(value), step=step, model_id=model_id or None)
    stop_system_metrics(run_id)
    client.set_terminated(run_id, status=status)


@task(cache_policy=NO_CACHE)
def publish_summary(tracking: TrackingRun, model: ModelRef, evaluation: EvalResult) -> None:
    """Prefect UI artifacts on the flow run: a link to the MLflow run, the evaluation and the gate's decision."""
    from prefect.artifacts import create_link_artifact, create_markdown_artifact

    model_url = ui_url(f"models/{model.name}/versions/{model.version}")
    get_run_logger().info("%s v%s: %s; MLflow run %s", model.name, model.version, model.decision, tracking.url)
    if tracking.url.startswith("http"):
        create_link_artifact(
            key="mlflow-run",
            link=tracking.url,
            link_text="MLflow run",
            description="Metrics, plots and the logged model of this flow run.",
        )
    episodes = "\n".join(f"| {i} | {value:.1f} |" for i, value in enumerate(evaluation.returns))
    create_markdown_artifact(
        key="training-summary",
        description="Evaluation and release gate",
        markdown=f"""\
## {model.name} v{model.version}: {model.decision or "no gate decision"}

- MLflow run: {_link(tracking.url)}
- Registered model: {_link(model_url)} · aliases **{", ".join(model.aliases) or "none"}**
- Evaluation: mean return **{evaluation.mean:.2f}** ± {evaluation.std:.2f} over {len(evaluation.returns)} \
episodes (seeds {evaluation.seed}…{evaluation.seed + len(evaluation.returns) - 1})

| episode | return |
|---|---|
{episodes}
""",
    )


def _link(url: str) -> str:
    return f"[{url}]({url})" if url.startswith("http") else f"`{url}`"
