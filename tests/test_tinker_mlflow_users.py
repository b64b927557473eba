"""The Tinker API on an MLflow server with its authentication app (the session's ``mlflow_auth_server``): the API,
as MLflow's admin, makes each tenant's experiment and registered-model names as it does for a job, and the engine
writes (runs, metrics, registered checkpoints) as the tenant's own MLflow user, holding no admin credential and no
secret that tenants' passwords derive from. A server of its own on the tiny Llama; the tests run in order (the last
one stops it)."""

from __future__ import annotations

import json
import os
import signal

import httpx
import numpy as np
import psutil
import pytest
from fixtures.tinker import TINY, TinkerServer, engine_state, environments, own_tinker_server, ray_processes
from tinker import types

pytestmark = pytest.mark.slow

A, B = "tka", "tkb"
TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun."


@pytest.fixture(scope="module")
def server(tmp_path_factory, mlflow_auth_server) -> TinkerServer:
    settings = mlflow_auth_server.settings()
    env = {
        "OPENTINKER_MLFLOW_TRACKING_URI": settings.mlflow_tracking_uri,
        "OPENTINKER_MLFLOW_ADMIN_USERNAME": settings.mlflow_admin_username,
        "OPENTINKER_MLFLOW_ADMIN_PASSWORD": settings.mlflow_admin_password,
        "OPENTINKER_MLFLOW_TENANT_SECRET": settings.mlflow_tenant_secret,
    }
    with own_tinker_server(tmp_path_factory.mktemp("tinker-mlflow-users"), env) as server:
        yield server


def _as(tenant: str, settings) -> httpx.Client:
    """MLflow's REST API as the tenant's own MLflow user (what its dashboard credentials open)."""
    from opentinker.server import mlflow_users

    creds = mlflow_users.credentials(tenant, settings)
    return httpx.Client(base_url=settings.mlflow_tracking_uri, auth=(creds.username, creds.password), timeout=30)


def _sampler_checkpoint(server: TinkerServer, tenant: str, steps: int) -> tuple[str, str]:
    """A training client of ``tenant`` trained ``steps`` steps, saved for a sampler: (its model id, the path)."""
    with server.service_client(tenant) as service:  # the session finished on the way out: the checkpoint stays
        training = service.create_lora_training_client(base_model=TINY, rank=4, seed=5).result()
        tokens = training.get_tokenizer().encode(TEXT)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": np.ones(len(tokens) - 1, np.float32)},
        )
        for _ in range(steps):
            training.forward_backward([datum], "cross_entropy")
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        return training.model_id, training.save_weights_for_sampler("final").result().path


def test_checkpoints_register_as_the_tenants_own_user_and_never_under_a_name_another_tenant_holds(
    server, mlflow_auth_server
):
    settings = mlflow_auth_server.settings()
    model_a, path_a = _sampler_checkpoint(server, A, steps=1)
    with server.http(A) as http:
        answer = http.post("/api/v1/register_checkpoint", json={"path": path_a, "model_name": "poet", "alias": "live"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["model_name"] == f"{A}.poet"
    with _as(A, settings) as mlflow_a:
        experiment = mlflow_a.get("/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": f"tenant-{A}"})
        runs = mlflow_a.post(
            "/api/2.0/mlflow/runs/search",
            json={
                "experiment_ids": [experiment.json()["experiment"]["experiment_id"]],
                "filter": f"tags.`tinker.model_id` = '{model_a}'",
            },
        ).json()["runs"]
        run_id = runs[0]["info"]["run_id"]
        history = mlflow_a.get(
            "/api/2.0/mlflow/metrics/get-history", params={"run_id": run_id, "metric_key": "train/loss"}
        )
        assert len(history.json()["metrics"]) == 1  # the step's metrics, written by the engine as tenant-tka
        version = mlflow_a.get("/api/2.0/mlflow/registered-models/alias", params={"name": f"{A}.poet", "alias": "live"})
        assert version.status_code == 200 and version.json()["model_version"]["run_id"] == run_id

        # A, with its own MLflow user, makes the name B's registration would use and grants B on it (to read later
        # what B would write there): the API refuses to register there, as it refuses such a name for a job.
        _, path_b = _sampler_checkpoint(server, B, steps=0)  # B's MLflow user exists from here on
        assert mlflow_a.post("/api/2.0/mlflow/registered-models/create", json={"name": f"{B}.poet"}).status_code == 200
        grant = {"username": f"tenant-{B}", "resource_type": "registered_model", "resource_id": f"{B}.poet"}
        granted = mlflow_a.post("/api/3.0/mlflow/users/permissions/grant", json={**grant, "permission": "READ"})
        assert granted.status_code == 200, granted.text
        with server.http(B) as http:
            refused = http.post("/api/v1/register_checkpoint", json={"path": path_b, "model_name": "poet"})
            assert refused.status_code == 403, refused.text
            assert f"'{B}.poet' was made by another MLflow user (tenant-{A})" in refused.json()["detail"]
            taken = mlflow_a.get("/api/2.0/mlflow/registered-models/get", params={"name": f"{B}.poet"}).json()
            assert not taken["registered_model"].get("latest_versions")  # nothing of B's went there
            kept = http.post("/api/v1/register_checkpoint", json={"path": path_b, "model_name": "verse"})
            assert kept.status_code == 200 and kept.json()["model_name"] == f"{B}.verse", kept.text
        assert mlflow_a.get("/api/2.0/mlflow/registered-models/get", params={"name": f"{B}.verse"}).status_code == 403
    with _as(B, settings) as mlflow_b:
        assert mlflow_b.get("/api/2.0/mlflow/registered-models/get", params={"name": f"{B}.verse"}).status_code == 200
        assert mlflow_b.get("/api/2.0/mlflow/registered-models/get", params={"name": f"{A}.poet"}).status_code == 403


def test_the_engine_holds_no_mlflow_admin_or_tenant_secret(server, mlflow_auth_server):
    """After the writes above: the API holds the admin's password and the tenants' secret, the engine (its
    settings, its environment, every process of its Ray) neither; so what it wrote in a tenant's experiment, which
    MLflow lets only that tenant's user (and admins) write, it wrote as that tenant's user."""
    settings = mlflow_auth_server.settings()
    secrets = {settings.mlflow_admin_password, settings.mlflow_tenant_secret}
    api = environments([psutil.Process(server.handle.service.pid)])[0]
    assert api["OPENTINKER_MLFLOW_ADMIN_PASSWORD"] == settings.mlflow_admin_password
    held, environ = engine_state(server)
    assert held["mlflow_tracking_uri"] == settings.mlflow_tracking_uri  # the engine's real settings, less these
    assert held["mlflow_admin_username"] == held["mlflow_admin_password"] == held["mlflow_tenant_secret"] == ""
    for found in (held, environ, *environments(ray_processes(server))):
        assert not secrets & {str(value) for value in found.values()}


def test_the_api_that_started_the_engines_ray_stops_it_when_it_stops(server):
    """The other side of the record's one writer (tests/test_tinker_restart.py: another API's stop leaves it)."""
    state_path = server.handle.data_dir / "server" / "ray" / "state.json"
    head = psutil.Process(json.loads(state_path.read_text())["nodes"]["head"]["pid"])
    os.kill(server.handle.service.pid, signal.SIGTERM)  # the API's own shutdown, not a signal to the whole tree
    assert server.handle.service.exit_code(timeout=60) is not None  # uvicorn re-raises the signal once stopped
    head.wait(30)
    assert json.loads(state_path.read_text())["nodes"] == {}
