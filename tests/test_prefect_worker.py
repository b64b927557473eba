"""A train_flow deployment on a process work pool is picked up by a real `prefect worker` process and finishes,
registering a model version in the MLflow store the worker's flow run used."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

from opentinker.infra.processes import spawn
from opentinker.infra.settings import get_settings

pytestmark = pytest.mark.slow

POOL = "opentinker-test-pool"
MODEL = "worker-cartpole"


def test_process_worker_runs_a_train_flow_deployment(prefect_server, tmp_path):
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    config = tmp_path / "worker.toml"
    config.write_text(
        f'model_name = "{MODEL}"\nrun_name = "worker-run"\nseed = 5\nnum_envs = 4\nworkers = 1\n'
        "eval_episodes = 2\nchampion_threshold = 0.0\n[ppo]\nn_steps = 128\n"
    )
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_server,
        "OPENTINKER_PREFECT_API_URL": prefect_server,
        "PREFECT_WORKER_QUERY_SECONDS": "2",
    }
    bin_dir = Path(sys.executable).parent
    deployed = subprocess.run(
        [
            str(bin_dir / "opentinker"),
            "publish",
            "CartPole-v1",
            "--pool",
            POOL,
            "--name",
            "worker-test",
            "--steps",
            "2048",
            "--config",
            str(config),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    assert "train/worker-test" in deployed.stdout

    log = tmp_path / "worker.log"
    prefect_exe = bin_dir / "prefect"
    worker_cmd = [str(prefect_exe), "worker", "start", "--pool", POOL, "--type", "process", "--name", "test-worker"]
    worker = spawn("prefect worker", worker_cmd, log, url="", ports={}, env=env)
    try:
        with temporary_settings({PREFECT_API_URL: prefect_server}):
            flow_run = run_deployment("train/worker-test", timeout=480, poll_interval=2, as_subflow=False)
        assert worker.alive(), f"worker exited early:\n{log.read_text()[-3000:]}"
        assert flow_run.state is not None and flow_run.state.is_completed(), (flow_run.state, log.read_text()[-3000:])
    finally:
        worker.stop()
    # The worker, not this process, ran the flow: the run carries the worker's name and the pool.
    assert flow_run.work_pool_name == POOL
    with temporary_settings({PREFECT_API_URL: prefect_server}):
        from prefect import get_client

        with get_client(sync_client=True) as client:
            finished = client.read_flow_run(flow_run.id)
    assert finished.state.is_completed()
    assert "test-worker" in worker.log_text()  # what the worker printed, not the command line above it

    client = mlflow.MlflowClient(get_settings().tracking_uri)
    version = client.get_model_version_by_alias(MODEL, "candidate")
    run = client.get_run(version.run_id)
    assert run.data.tags["prefect.flow_run_id"] == str(flow_run.id)
    assert run.data.params["steps"] == "2048"
