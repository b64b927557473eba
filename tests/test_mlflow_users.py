"""Each tenant's own MLflow user on an MLflow server with its authentication app (opentinker/server/mlflow_users.py).

The server (admin) makes the tenant's user, experiment and registered models and grants the tenant MANAGE on them;
everything else is written and read with the tenant's credentials, and MLflow itself answers 403 to another tenant.
Real processes: the session's SeaweedFS S3 and an MLflow server with ``--app-name basic-auth`` on loopback.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import httpx
import pytest

from opentinker.server import mlflow_users
from opentinker.server.models import prepare_store, tenant_mlflow

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def written(mlflow_auth_server):
    """Tenants ``ua`` and ``ub``, each with a run (a metric, an artifact) and a registered model version, written
    as an attempt writes them: the server prepares, the tenant's own user writes."""
    settings = mlflow_auth_server.settings()
    made = {}
    for tenant in ("ua", "ub"):
        prepare_store(tenant, settings, (f"{tenant}.policy",))
        with tenant_mlflow(tenant, settings) as mlflow:
            client = mlflow.MlflowClient()
            experiment = client.get_experiment_by_name(f"tenant-{tenant}")
            run = client.create_run(experiment.experiment_id)
            client.log_metric(run.info.run_id, "charts/episodic_return_mean", 10.0, step=1)
            with tempfile.TemporaryDirectory() as folder:
                (Path(folder) / "policy.json").write_text("{}")
                client.log_artifacts(run.info.run_id, folder, "export")
            client.set_terminated(run.info.run_id)
            version = client.create_model_version(
                f"{tenant}.policy", f"runs:/{run.info.run_id}/export", run.info.run_id
            )
            client.set_registered_model_alias(f"{tenant}.policy", "champion", version.version)
        made[tenant] = {"experiment_id": experiment.experiment_id, "run_id": run.info.run_id}
    return settings, made


def _as(tenant: str, settings) -> httpx.Client:
    creds = mlflow_users.credentials(tenant, settings)
    return httpx.Client(base_url=settings.mlflow_tracking_uri, auth=(creds.username, creds.password), timeout=30)


def test_a_tenant_reads_its_own_run_and_model_and_none_of_the_other_tenants(written):
    settings, made = written
    a, b = made["ua"], made["ub"]
    with _as("ua", settings) as http:
        assert http.get("/api/2.0/mlflow/runs/get", params={"run_id": a["run_id"]}).status_code == 200
        own = http.get("/api/2.0/mlflow/registered-models/get", params={"name": "ua.policy"})
        assert own.status_code == 200 and own.json()["registered_model"]["aliases"][0]["alias"] == "champion"
        for path, params in (
            ("/api/2.0/mlflow/experiments/get", {"experiment_id": b["experiment_id"]}),
            ("/ajax-api/2.0/mlflow/experiments/get", {"experiment_id": b["experiment_id"]}),
            ("/api/2.0/mlflow/experiments/get-by-name", {"experiment_name": "tenant-ub"}),
            ("/api/2.0/mlflow/runs/get", {"run_id": b["run_id"]}),
            (
                "/api/2.0/mlflow/metrics/get-history",
                {"run_id": b["run_id"], "metric_key": "charts/episodic_return_mean"},
            ),
            ("/api/2.0/mlflow/registered-models/get", {"name": "ub.policy"}),
            ("/api/2.0/mlflow/model-versions/get", {"name": "ub.policy", "version": "1"}),
            ("/api/2.0/mlflow/registered-models/alias", {"name": "ub.policy", "alias": "champion"}),
            ("/get-artifact", {"run_uuid": b["run_id"], "path": "export/policy.json"}),
            ("/model-versions/get-artifact", {"name": "ub.policy", "version": "1", "path": "policy.json"}),
        ):
            assert http.get(path, params=params).status_code == 403, path
        listed = http.post("/api/2.0/mlflow/experiments/search", json={"max_results": 100}).json()
        assert [e["name"] for e in listed["experiments"]] == ["tenant-ua"]
        models = http.get("/api/2.0/mlflow/registered-models/search").json()
        assert [m["name"] for m in models["registered_models"]] == ["ua.policy"]
        runs = http.post("/api/2.0/mlflow/runs/search", json={"experiment_ids": [b["experiment_id"]]})
        assert runs.status_code in (200, 403) and not runs.json().get("runs")
    unauthenticated = httpx.get(
        f"{settings.mlflow_tracking_uri}/api/2.0/mlflow/runs/get", params={"run_id": a["run_id"]}
    )
    assert unauthenticated.status_code == 401


def test_the_server_reads_a_tenants_data_with_that_tenants_credentials_only(written):
    settings, made = written
    with tenant_mlflow("ua", settings) as mlflow:
        with tempfile.TemporaryDirectory() as folder:
            path = mlflow.artifacts.download_artifacts(artifact_uri="models:/ua.policy@champion", dst_path=folder)
            assert (Path(path) / "policy.json").exists()
        with pytest.raises(Exception, match=r"403|Permission denied"):
            mlflow.artifacts.download_artifacts(artifact_uri="models:/ub.policy/1", dst_path=tempfile.mkdtemp())
    another_process = mlflow_users.TenantIdentities(settings)  # a second server process: same names, same grants
    assert another_process.ensure_experiment("ua") == made["ua"]["experiment_id"]
    another_process.ensure_model("ua", "ua.policy")
    env = mlflow_users.credentials("ua", settings)
    assert env.username == "tenant-ua" and len(env.password) >= 40
    assert mlflow_users.credentials("ua", settings) == env  # derived: every server process agrees
    assert mlflow_users.credentials("ub", settings).password != env.password


def test_a_name_another_tenant_made_first_is_refused_not_shared(written):
    """Tenant ua, with its own credentials, makes what tenant uc's first job would use and grants uc on them (to
    read uc's runs later): the server refuses to write there."""
    settings, _ = written
    identities = mlflow_users.identities(settings)
    identities.ensure_user("uc")
    with _as("ua", settings) as http:
        assert http.post("/api/2.0/mlflow/registered-models/create", json={"name": "uc.policy"}).status_code == 200
        experiment = http.post("/api/2.0/mlflow/experiments/create", json={"name": "tenant-uc"})
        assert experiment.status_code == 200
        for resource_type, resource_id in (
            ("registered_model", "uc.policy"),
            ("experiment", experiment.json()["experiment_id"]),
        ):
            grant = {"username": "tenant-uc", "resource_type": resource_type, "resource_id": resource_id}
            answer = http.post("/api/3.0/mlflow/users/permissions/grant", json={**grant, "permission": "READ"})
            assert answer.status_code == 200, answer.text
    with pytest.raises(mlflow_users.MlflowIdentityError, match=r"'uc\.policy' was made by another MLflow user"):
        identities.ensure_model("uc", "uc.policy")
    with pytest.raises(mlflow_users.MlflowIdentityError, match=r"'tenant-uc' was made by another MLflow user"):
        identities.ensure_experiment("uc")
    with pytest.raises(mlflow_users.MlflowIdentityError, match=r"not in tenant uc's namespace"):
        identities.ensure_model("uc", "ua.policy")


def test_job_model_names_cover_every_model_a_job_registers():
    from opentinker.tasks.spec import RunSpec

    spec = RunSpec(env_id="CartPole-v1", model_name="t.cart")
    assert mlflow_users.job_model_names(spec) == ["t.cart"]
    group = RunSpec(env_id="pursuit", algorithm="group", model_name="t.pursuit")
    assert mlflow_users.job_model_names(group) == ["t.pursuit-predator", "t.pursuit-prey"]


def test_the_dashboard_on_the_embedded_stack_says_what_it_needs(api_server):
    """No MLflow server with users: the route and `opentinker dashboard` answer in one line what is needed."""
    import os
    import subprocess
    import sys

    key = api_server.make_key("dash", ("read",))
    answer = httpx.get(f"{api_server.url}/v1/dashboard", headers=api_server.headers(key), timeout=30)
    assert answer.status_code == 409 and "MLflow server with its authentication app" in answer.json()["detail"]
    no_read = api_server.make_key("dash", ("jobs",))
    assert httpx.get(f"{api_server.url}/v1/dashboard", headers=api_server.headers(no_read)).status_code == 403
    env = {**os.environ, "OPENTINKER_SERVER_URL": api_server.url, "OPENTINKER_API_KEY": key, "COLUMNS": "300"}
    cli = subprocess.run(
        [str(Path(sys.executable).parent / "opentinker"), "dashboard"], env=env, capture_output=True, text=True
    )
    assert cli.returncode == 1 and "per-tenant dashboards need an MLflow server" in cli.stdout, cli.stdout + cli.stderr
