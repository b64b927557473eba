"""`opentinker schedule` serves a cron deployment from a real process against a real Prefect server;
a run triggered through the API executes train_flow and registers a model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import mlflow
import pytest

from opentinker.infra.processes import spawn, wait_until
from opentinker.infra.settings import get_settings

pytestmark = pytest.mark.slow

DEPLOYMENT = "train/nightly-test"


def _read_deployment(api_url: str, name: str):
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}):
        with get_client(sync_client=True) as client:
            return client.read_deployment_by_name(name)


def _deployment_registered(api_url: str) -> bool:
    try:
        _read_deployment(api_url, DEPLOYMENT)
        return True
    except Exception:  # ObjectNotFound until serve() has registered it
        return False


def test_scheduled_deployment_runs_when_triggered_and_registers_a_model(prefect_server, tmp_path):
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    config = tmp_path / "nightly.toml"
    config.write_text(
        'model_name = "scheduled-cartpole"\nrun_name = "scheduled"\nseed = 3\nnum_envs = 4\nworkers = 2\n'
        "eval_episodes = 2\nchampion_threshold = 0.0\n[ppo]\nn_steps = 128\n"
    )
    log = tmp_path / "schedule.log"
    env = {**os.environ, "OPENTINKER_PREFECT_API_URL": prefect_server, "PREFECT_API_URL": prefect_server}
    exe = Path(sys.executable).with_name("opentinker")
    cmd = [str(exe), "schedule", "CartPole-v1", "--cron", "0 3 * * *", "--steps", "1024", "--config", str(config)]
    proc = spawn("opentinker schedule", [*cmd, "--name", "nightly-test"], log, url="", ports={}, env=env)
    try:
        wait_until(proc, lambda: _deployment_registered(prefect_server), 240.0, "its deployment was registered")
        deployment = _read_deployment(prefect_server, DEPLOYMENT)
        assert [s.schedule.cron for s in deployment.schedules] == ["0 3 * * *"]
        assert deployment.parameters["spec"]["model_name"] == "scheduled-cartpole"
        with temporary_settings({PREFECT_API_URL: prefect_server}):
            flow_run = run_deployment(DEPLOYMENT, timeout=420, poll_interval=2, as_subflow=False)
        assert flow_run.state is not None and flow_run.state.is_completed(), (flow_run.state, log.read_text()[-3000:])
    finally:
        proc.stop()
    client = mlflow.MlflowClient(get_settings().tracking_uri)
    version = client.get_model_version_by_alias("scheduled-cartpole", "candidate")
    run = client.get_run(version.run_id)
    assert run.data.tags["prefect.flow_run_id"] == str(flow_run.id)
    assert run.data.params["steps"] == "1024"
