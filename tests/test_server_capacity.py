"""A full cluster on a real `opentinker server up` whose capacity (``server_pool_limit``: the Prefect work pool's
concurrency limit) is one job: a second job, of another tenant, waits in the queue saying so, and starts when the
first one ends — a queue position, never a hang."""

from __future__ import annotations

import httpx
import pytest
from fixtures.server import start_test_server, wait_for_job

pytestmark = pytest.mark.slow

LONG = {"env_id": "CartPole-v1", "steps": 10_000_000, "num_envs": 4, "ppo": {"n_steps": 64}}
"""Runs until cancelled (the test never waits for it to end)."""


def test_a_full_cluster_shows_as_a_queue_position_naming_its_capacity(tmp_path_factory):
    server = start_test_server(
        tmp_path_factory.mktemp("one-slot-server"), jobs=True, extra_env={"OPENTINKER_SERVER_POOL_LIMIT": "1"}
    )
    try:
        keys = {tenant: server.make_key(tenant) for tenant in ("first", "second")}
        http = httpx.Client(timeout=120)

        def submit(tenant: str) -> str:
            answer = http.post(f"{server.url}/v1/jobs", headers=server.headers(keys[tenant]), json={"spec": LONG})
            assert answer.status_code == 201, answer.text
            return answer.json()["id"]

        first = submit("first")
        wait_for_job(server, keys["first"], first, lambda s: s["state"] == "RUNNING")
        second = submit("second")
        queued = wait_for_job(
            server,
            keys["second"],
            second,
            lambda s: s["state"] == "QUEUED" and s["queue"]["waiting_for"].startswith("cluster capacity"),
            timeout=60,
        )
        assert queued["queue"]["position"] == 1  # first in its own tenant's queue: the cluster, not the tenant, waits
        assert queued["queue"]["waiting_for"] == "cluster capacity: 1 of 1 jobs run in the pool"
        # The slot frees when the first job ends: the queued job starts on its own.
        assert http.post(f"{server.url}/v1/jobs/{first}/cancel", headers=server.headers(keys["first"])).is_success
        wait_for_job(server, keys["first"], first, lambda s: s["state"] == "CANCELLED", timeout=60)
        wait_for_job(server, keys["second"], second, lambda s: s["state"] == "RUNNING", timeout=120)
        assert http.post(f"{server.url}/v1/jobs/{second}/cancel", headers=server.headers(keys["second"])).is_success
        wait_for_job(server, keys["second"], second, lambda s: s["state"] == "CANCELLED", timeout=60)
    finally:
        server.stop()
