"""`opentinker server up` with ``server_prefect_database = postgres``: the embedded Prefect keeps its flow runs in an
embedded PostgreSQL that the server starts, adopts after a kill and stops with the rest of its stack."""

from __future__ import annotations

import json
import shutil

import httpx
import psycopg2
import pytest
from fixtures.server import start_test_server, wait_for_job

from opentinker.infra.postgres import cluster_dir, database_url, find_bindir
from opentinker.infra.processes import ServiceProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_bindir() is None, reason="PostgreSQL server binaries (Debian `postgresql`) not installed"),
]

SPEC = {
    "env_id": "CartPole-v1",
    "steps": 4096,
    "num_envs": 4,
    "eval_episodes": 2,
    "champion_threshold": 0.0,
    "ppo": {"n_steps": 64},
}


def test_the_embedded_prefect_on_postgres_runs_jobs_and_outlives_a_killed_server(tmp_path):
    server = start_test_server(tmp_path, jobs=True, extra_env={"OPENTINKER_SERVER_PREFECT_DATABASE": "postgres"})
    services_file = server.data_dir / "server" / "services.json"
    postgres_dir = server.data_dir / "server" / "postgres"
    try:
        key = server.make_key("pg")
        answer = httpx.post(f"{server.url}/v1/jobs", headers=server.headers(key), json={"spec": SPEC}, timeout=120)
        assert answer.status_code == 201, answer.text
        job = wait_for_job(server, key, answer.json()["id"], lambda s: s["state"] in ("SUCCEEDED", "FAILED"))
        assert job["state"] == "SUCCEEDED", job

        postgres = ServiceProcess.from_dict(json.loads(services_file.read_text())["postgres"])
        url = database_url(postgres_dir, postgres, "prefect").replace("+psycopg2", "")
        with psycopg2.connect(url) as connection, connection.cursor() as cursor:
            cursor.execute("SELECT state_type FROM flow_run WHERE id = %s", (job["flow_run_id"],))
            assert cursor.fetchone() == ("COMPLETED",)
        assert not list((server.data_dir / "server" / "prefect").rglob("prefect.db"))  # nothing went to SQLite

        server.kill()  # the API dies; its stack lives on and is adopted
        server.restart()
        assert json.loads(services_file.read_text())["postgres"]["pid"] == postgres.pid
        again = httpx.post(f"{server.url}/v1/jobs", headers=server.headers(key), json={"spec": SPEC}, timeout=120)
        assert again.status_code == 201, again.text
        second = wait_for_job(server, key, again.json()["id"], lambda s: s["state"] in ("SUCCEEDED", "FAILED"))
        assert second["state"] == "SUCCEEDED", second
    finally:
        server.stop()
        if cluster_dir(postgres_dir).parent != postgres_dir:
            shutil.rmtree(cluster_dir(postgres_dir), ignore_errors=True)
    assert not postgres.alive()  # stopped with the stack, after Prefect
