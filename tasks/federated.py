"""Prefect tasks of a federated run, each one step that can be retried whole; `flows/federated_flow.py` wires them."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from opentinker.federated import deploy
from opentinker.federated.config import FedConfig
from opentinker.federated.server_app import FederatedResult
from opentinker.infra.processes import port_open


@task(name="federation-ready", retries=1, retry_delay_seconds=5)
def ensure_federation(root: str | None, sites: int) -> str:
    """Use the running federation at `root` when its SuperLink answers; else start one (`deploy.up`).

    Returns its root."""
    try:
        fed = deploy.Federation.load(root)
        if fed.superlink is not None and fed.superlink.alive() and port_open(fed.port):
            return fed.root
    except deploy.FederationError:
        pass
    return deploy.up(sites, root).root


@task(name="federated-run")
def run_federated(root: str, config: dict) -> FederatedResult:
    """`flwr run` the app (the ServerApp logs every round to MLflow and registers the final global model)."""
    return deploy.submit(deploy.Federation.load(root), FedConfig(**config))


@task(name="check-registered-model", retries=2, retry_delay_seconds=3)
def check_registered_model(name: str, alias: str, expected_version: str) -> str:
    """The alias must point at the version this run registered; returns the URI serving loads."""
    from opentinker.tracking.registry import resolve_policy

    uri = f"models:/{name}@{alias}"
    ref = resolve_policy(uri)
    if ref.version != expected_version:
        raise RuntimeError(f"{uri} resolves to version {ref.version}, expected {expected_version} from this run")
    return uri


@task(name="federation-down")
def stop_federation(root: str) -> None:
    deploy.down(Path(root))
