"""The federated flow: make sure the SuperLink/SuperNodes run → run the rounds → check the registered global model."""

from __future__ import annotations

from prefect import flow

from opentinker.tasks.federated import check_registered_model, ensure_federation, run_federated, stop_federation


@flow(name="federated", log_prints=True)
def federated_flow(config: dict, root: str | None = None, stop_after: bool = False) -> dict:
    """Run one federated training (`config`: FedConfig fields) on the loopback federation at `root`.

    Returns the run's summary: status, rounds, per-round history, MLflow run id, model URI.
    """
    sites = int(config.get("num_sites", 3))
    federation_root = ensure_federation(root, sites)
    try:
        result = run_federated(federation_root, config)
        model_uri = ""
        if result.model_version:
            model_uri = check_registered_model(
                config.get("register_as", "federated-policy"), config.get("alias", "federated"), result.model_version
            )
    finally:
        if stop_after:
            stop_federation(federation_root)
    print(f"federated run {result.status}: {result.rounds} rounds, model {model_uri or '-'}")
    return {
        "status": result.status,
        "rounds": result.rounds,
        "history": result.history,
        "mlflow_run_id": result.mlflow_run_id,
        "model_uri": model_uri,
    }
