"""`train_flow` on an autoscaling loopback cluster, reached through settings alone: Ray's autoscaler launches the
rollout nodes the run asks for, removes them once idle, and a request no node type can meet fails at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import mlflow
import psutil
import pytest
from fixtures.pipeline import settings_env, small_train_params
from ray.autoscaler.v2.sdk import get_cluster_status
from typer.testing import CliRunner

from opentinker.cli import cluster as cluster_cli
from opentinker.envs.ray_backend import START_TIMEOUT_S
from opentinker.infra.autoscale import WORKER_TYPE
from opentinker.infra.cluster import WORKER_RESOURCE, LocalCluster
from opentinker.infra.settings import get_settings

# A user's script: its only link to the cluster is the environment (OPENTINKER_RAY_ADDRESS, _ROLLOUT_RESOURCE).
DRIVER = r"""
import json, sys, time
from opentinker.flows.params import TrainParams
from opentinker.flows.train import train_flow

feasible, impossible = (TrainParams.model_validate_json(arg) for arg in sys.argv[1:])
result = train_flow(feasible)
print("RESULT " + json.dumps({"result": result.model_dump(), "ended": time.time()}), flush=True)
started = time.monotonic()
try:
    train_flow(impossible)
except Exception as exc:
    failure = {"type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - started}
    print("FAILED " + json.dumps(failure), flush=True)
"""

IDLE_TIMEOUT_S = 10.0
REMOVAL_SLACK_S = 10.0
"""Beyond the idle timeout: the autoscaler's 1 s passes, draining the node and stopping its raylet on busy cores."""


def _rollout_nodes(address: str) -> dict[str, float]:
    """Alive nodes of the autoscaled worker type and since when each is idle (0: busy), as Ray's autoscaler reports
    them (what `ray status` shows)."""
    status, now = get_cluster_status(address), time.time()
    return {
        node.node_id: now - node.resource_usage.idle_time_ms / 1000 if node.resource_usage.idle_time_ms else 0.0
        for node in status.active_nodes + status.idle_nodes
        if node.ray_node_type_name == WORKER_TYPE
    }


def _line(lines: list[str], prefix: str) -> dict:
    return json.loads(next(line for line in lines if line.startswith(prefix))[len(prefix) :])


@pytest.mark.slow
def test_autoscaler_launches_rollout_nodes_for_a_run_removes_them_when_idle_and_rejects_an_impossible_request(
    tmp_path, prefect_server
):
    # 2 actors of 1 CPU each, on 1-CPU nodes: the run needs 2 rollout nodes, and the cluster starts with none.
    feasible = small_train_params(
        steps=2048,
        num_envs=2,
        workers=2,
        rollout_num_cpus=1.0,
        rollout_num_gpus=0.0,
        model_name="test-autoscale",
        run_name="autoscale",
    )
    impossible = feasible.model_copy(update={"rollout_num_cpus": 2.0, "run_name": "autoscale-impossible"})
    out, log = tmp_path / "out.txt", tmp_path / "driver.log"
    driver, idle_since, gone = None, {}, {}  # node id -> since when idle (0: busy) at its last report; when it vanished
    # `opentinker cluster up` autoscales because the settings say so: at most 3 nodes, the head and 2 workers.
    with settings_env(OPENTINKER_DATA_DIR=str(tmp_path), OPENTINKER_CLUSTER_IDLE_TIMEOUT_S=str(IDLE_TIMEOUT_S)):
        cluster = LocalCluster()
        up = CliRunner().invoke(
            cluster_cli.app, ["up", "--nodes", "3", "--cpus-per-node", "1", "--object-store-mb", "128"]
        )
    try:
        assert up.exit_code == 0, up.output
        address, temp_dir = cluster.address, json.loads(cluster.state_path.read_text())["temp_dir"]
        assert list(cluster.nodes()) == ["head"]
        assert not _rollout_nodes(address)
        # The session's data dir (its MLflow store) and Prefect server: their start-up is not what is tested here.
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(
            OPENTINKER_RAY_ADDRESS=address,
            OPENTINKER_ROLLOUT_RESOURCE=WORKER_RESOURCE,
            OPENTINKER_PREFECT_API_URL=prefect_server,
            PREFECT_API_URL=prefect_server,  # as in `opentinker stack up`'s stack.env
        )
        with out.open("w") as stdout, log.open("w") as stderr:
            driver = subprocess.Popen(
                [sys.executable, "-c", DRIVER, feasible.model_dump_json(), impossible.model_dump_json()],
                env=env,
                text=True,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )
        # Watch the nodes until the driver is done and every launched node is gone again.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            alive, now = _rollout_nodes(address), time.time()
            idle_since.update(alive)
            gone.update((node, now) for node in idle_since.keys() - alive.keys() - gone.keys())
            if driver.poll() is not None and not alive:
                break
            time.sleep(0.5)
        assert driver.wait(timeout=30) == 0, log.read_text()[-4000:]
        assert not _rollout_nodes(address), f"rollout nodes still alive: {idle_since}"
    finally:
        if driver is not None and driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
        cluster.down()

    lines = out.read_text().splitlines()
    report = _line(lines, "RESULT ")
    client = mlflow.MlflowClient(get_settings().tracking_uri)
    run = client.get_run(report["result"]["run_id"])
    assert report["result"]["global_step"] >= feasible.steps
    # The run trained on 2 nodes the autoscaler launched for it (none existed when it started)...
    nodes = run.data.tags["opentinker.rollout_nodes"].split(",")
    assert len(set(nodes)) == 2 and set(nodes) <= idle_since.keys(), (nodes, idle_since)
    assert run.data.metrics["perf/rollout_nodes"] == 2
    waits = [
        m.value
        for m in sorted(client.get_metric_history(run.info.run_id, "perf/capacity_wait_s"), key=lambda m: m.step)
    ]
    assert len(waits) == 2 and 0 < waits[0] <= waits[1] == run.data.metrics["perf/capacity_wait_s"], waits
    # ...and which the autoscaler removed once they had been idle for the idle timeout (not before).
    # (-1 s: the idle time in a report is up to the raylet's report period old, so "since" may come out a bit late.)
    idle_for = {node: gone[node] - idle_since[node] for node in set(nodes)}
    assert all(IDLE_TIMEOUT_S - 1 <= s <= IDLE_TIMEOUT_S + REMOVAL_SLACK_S for s in idle_for.values()), idle_for
    assert max(idle_since[node] for node in nodes) <= report["ended"]  # idle from training's end, before the flow's

    failure = _line(lines, "FAILED ")
    assert failure["type"] == "ClusterResourceError", failure
    assert "reports the rollout actors' request infeasible" in failure["message"], failure
    assert "CPU: 2 (rollout_num_cpus)" in failure["message"], failure
    assert failure["seconds"] < START_TIMEOUT_S / 4, failure  # the autoscaler's report, not the start timeout

    leftovers = [p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, f"Ray processes of the cluster outlived `down`: {[p.pid for p in leftovers]}"
    print(
        "autoscale figures: "
        + json.dumps(
            {
                "scale_up_s": waits[0],  # the probe's 2 actors: both workers launched and the actors running
                "capacity_wait_s": run.data.metrics["perf/capacity_wait_s"],
                "removed_after_idle_s": {node[-5:]: round(idle, 1) for node, idle in idle_for.items()},
                "infeasible_failure_s": round(failure["seconds"], 1),
            }
        )
    )
