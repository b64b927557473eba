"""One MLflow run per flow run: opened before training with params and provenance tags, closed with a status."""
from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from opentinker.tasks.retry import IO_BACKOFF, IO_RETRIES, retry_transient
from opentinker.tasks.tracking import configure_mlflow, flatten, git_commit, run_url


class TrackingRun(BaseModel):
    run_id: str
    experiment_id: str
    url: str


@task(cache_policy=NO_CACHE, retries=IO_RETRIES, retry_delay_seconds=IO_BACKOFF, retry_condition_fn=retry_transient)
def start_tracking_run(params: dict[str, Any], run_name: str, experiment: str | None = None) -> TrackingRun:
    """Create the MLflow run; tags link it to the Prefect flow run and the code that produced it."""
    import mlflow
    from prefect.runtime import flow_run

    experiment_id = configure_mlflow(experiment)
    client = mlflow.MlflowClient()
    tags = {
        "mlflow.runName": run_name,
        "mlflow.source.git.commit": git_commit(),
        "opentinker.env_id": str(params.get("env_id")),
        "opentinker.algorithm": str(params.get("algorithm", "ppo")),
        "prefect.flow_run_id": str(flow_run.id or ""),
        "prefect.flow_run_name": str(flow_run.name or ""),
    }
    run = client.create_run(experiment_id, run_name=run_name, tags=tags)
    from mlflow.entities import Param

    client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in flatten(params).items()])
    return TrackingRun(run_id=run.info.run_id, experiment_id=experiment_id, url=run_url(run.info.run_id, experiment_id))


@task(cache_policy=NO_CACHE, retries=IO_RETRIES, retry_delay_seconds=IO_BACKOFF, retry_condition_fn=retry_transient)
def finish_tracking_run(
    run_id: str,
    status: str = "FINISHED",
    tags: dict[str, str] | None = None,
    metrics: dict[str, float] | None = None,
    step: int = 0,
) -> None:
    """Final tags and summary metrics (evaluation, at the last global step), then close the run."""
    import mlflow

    configure_mlflow()
    client = mlflow.MlflowClient()
    for key, value in (tags or {}).items():
        client.set_tag(run_id, key, value)
    for key, value in (metrics or {}).items():
        client.log_metric(run_id, key, float(value), step=step)
    client.set_terminated(run_id, status=status)
