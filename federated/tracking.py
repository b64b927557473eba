"""MLflow edge of the federated server: one parent run per federated run, per-round metrics, the final model."""

from __future__ import annotations

import tempfile
from pathlib import Path

from opentinker.federated import task
from opentinker.federated.config import FedConfig
from opentinker.federated.rounds import RoundStats


def open_parent_run(config: FedConfig, existing_run_id: str = "") -> str:
    """The run to log into: the checkpoint's run when resuming (params are immutable), else a new one with params."""
    import mlflow

    from opentinker.tracking.runs import ensure_experiment

    experiment_id = ensure_experiment()
    client = mlflow.MlflowClient()
    if existing_run_id:
        client.update_run(existing_run_id, status="RUNNING")
        return existing_run_id
    run = client.create_run(experiment_id, run_name=config.run_name, tags={"opentinker.kind": "federated"})
    for key, value in config.to_run_config().items():
        client.log_param(run.info.run_id, f"fed.{key}", value)
    return run.info.run_id


def log_round(run_id: str, stats: RoundStats) -> None:
    import mlflow

    from opentinker.tracking.runs import configure_mlflow

    configure_mlflow()
    client = mlflow.MlflowClient()
    metrics = [mlflow.entities.Metric(key, value, 0, stats.round) for key, value in stats.metrics().items()]
    client.log_batch(run_id, metrics=metrics)


def finish_run(run_id: str, status: str) -> None:
    import mlflow

    mlflow.MlflowClient().set_terminated(run_id, status=status)


def register_global_model(run_id: str, config: FedConfig, weights: task.Weights, rounds: int) -> str:
    """Export the global policy, log it in the parent run, register it as `register_as` with `alias`: the version."""
    from opentinker.tracking.registry import log_policy_model, register_policy

    with tempfile.TemporaryDirectory(prefix="opentinker-fed-export-") as tmp:
        export_dir = task.export_global_policy(
            config.env,
            weights,
            Path(tmp) / "policy",
            metadata={"federated_rounds": rounds, "strategy": config.strategy},
        )
        model_uri = log_policy_model(export_dir, run_id=run_id)
    return str(register_policy(model_uri, config.register_as, alias=config.alias or None).version)
