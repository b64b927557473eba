"""MLflow tracking and registry on a real PostgreSQL server; concurrent writers lose nothing, versions stay unique."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from opentinker.infra.postgres import cluster_dir, find_bindir, start_postgres
from opentinker.infra.services import start_mlflow

pytestmark = pytest.mark.skipif(
    find_bindir() is None, reason="PostgreSQL server binaries (Debian `postgresql`) not installed"
)

WRITERS = 4
VERSIONS_PER_WRITER = 3
STEPS = 10

# One writer process: waits for the start signal so all writers hit the store at once.
WRITER = r"""
import json, os, sys, time
import mlflow
tracking_uri, experiment_id, model, go_file, versions, steps = sys.argv[1:7]
client = mlflow.MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
while not os.path.exists(go_file):
    time.sleep(0.05)
out = []
for i in range(int(versions)):
    run = client.create_run(experiment_id, tags={"writer": str(os.getpid())})
    client.log_param(run.info.run_id, "index", i)
    for step in range(int(steps)):
        client.log_metric(run.info.run_id, "charts/episodic_return", float(step), step=step)
    version = client.create_model_version(model, source=f"runs:/{run.info.run_id}/model", run_id=run.info.run_id)
    client.set_terminated(run.info.run_id)
    out.append({"run_id": run.info.run_id, "version": int(version.version)})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def postgres_mlflow(s3_server, tmp_path_factory):
    """(MLflow server URL, PostgreSQL URI) with the server's backend store on PostgreSQL and artifacts on S3."""
    root = tmp_path_factory.mktemp("pg-mlflow")
    postgres, db_uri = start_postgres(root / "postgres", root / "postgres.log")
    try:
        mlflow_service = start_mlflow(root / "mlflow", root / "mlflow.log", s3_server, backend_store_uri=db_uri)
        try:
            yield mlflow_service.url, db_uri
        finally:
            mlflow_service.stop()
    finally:
        postgres.stop()
        if cluster_dir(root / "postgres").parent != root / "postgres":  # root-only fallback location under /tmp
            shutil.rmtree(cluster_dir(root / "postgres"), ignore_errors=True)


def _rows(db_uri: str, sql: str, *params) -> list[tuple]:
    import psycopg2

    with psycopg2.connect(db_uri.replace("+psycopg2", "")) as connection, connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


@pytest.mark.slow  # a real PostgreSQL server
def test_tracking_and_registry_are_stored_in_postgres(postgres_mlflow):
    import mlflow

    server, db_uri = postgres_mlflow
    client = mlflow.MlflowClient(tracking_uri=server, registry_uri=server)
    experiment_id = client.create_experiment(f"pg-{uuid.uuid4().hex[:8]}")
    run = client.create_run(experiment_id)
    client.log_param(run.info.run_id, "lr", "0.001")
    client.log_metric(run.info.run_id, "losses/value_loss", 0.5, step=3)
    name = f"policy-{uuid.uuid4().hex[:6]}"
    client.create_registered_model(name)
    version = client.create_model_version(name, source=f"runs:/{run.info.run_id}/model", run_id=run.info.run_id)
    client.set_registered_model_alias(name, "champion", version.version)

    assert client.get_model_version_by_alias(name, "champion").run_id == run.info.run_id
    assert _rows(db_uri, "SELECT value FROM params WHERE run_uuid = %s AND key = 'lr'", run.info.run_id) == [("0.001",)]
    assert _rows(db_uri, "SELECT alias, version FROM registered_model_aliases WHERE name = %s", name) == [
        ("champion", 1)
    ]


@pytest.mark.slow
def test_concurrent_writers_get_unique_versions_and_lose_nothing(postgres_mlflow, tmp_path):
    import mlflow

    server, db_uri = postgres_mlflow
    client = mlflow.MlflowClient(tracking_uri=server, registry_uri=server)
    experiment_id = client.create_experiment(f"concurrent-{uuid.uuid4().hex[:8]}")
    model = f"shared-{uuid.uuid4().hex[:6]}"
    client.create_registered_model(model)
    go = tmp_path / "go"
    # Half the writers go through the tracking server, half straight to the database (each its own engine).
    uris = [server if i % 2 == 0 else db_uri for i in range(WRITERS)]
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, uri, experiment_id, model, str(go), str(VERSIONS_PER_WRITER), str(STEPS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ},
        )
        for uri in uris
    ]
    time.sleep(1.0)
    go.touch()
    results = []
    for writer in writers:
        out, err = writer.communicate(timeout=600)
        assert writer.returncode == 0, err[-3000:]
        results += json.loads(out.strip().splitlines()[-1])

    total = WRITERS * VERSIONS_PER_WRITER
    assert sorted(r["version"] for r in results) == list(range(1, total + 1))
    registered = client.search_model_versions(f"name = '{model}'")
    assert {(int(v.version), v.run_id) for v in registered} == {(r["version"], r["run_id"]) for r in results}
    runs = client.search_runs([experiment_id], max_results=100)
    assert len(runs) == total and all(run.info.status == "FINISHED" for run in runs)
    for run in runs:
        history = client.get_metric_history(run.info.run_id, "charts/episodic_return")
        assert [m.step for m in sorted(history, key=lambda m: m.step)] == list(range(STEPS))
