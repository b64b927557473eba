"""`opentinker cluster up|status|down`: separate raylets on loopback, placement observable by node id."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from opentinker.infra.cluster import ClusterError, LocalCluster
from opentinker.infra.settings import Settings

# Runs in its own process: connects only through the settings (OPENTINKER_RAY_ADDRESS), as user code would.
DRIVER = r"""
import json, ray
from opentinker.infra.ray_runtime import ensure_ray

ensure_ray()

@ray.remote(num_cpus=1, resources={"rollout_node": 1}, max_retries=0)
def where():
    return ray.get_runtime_context().get_node_id()

nodes = [n for n in ray.nodes() if n["Alive"]]
print(json.dumps({
    "task_node": ray.get(where.remote(), timeout=120),
    "driver_node": ray.get_runtime_context().get_node_id(),
    "nodes": [
        {"id": n["NodeID"], "port": n["NodeManagerPort"], "rollout": n["Resources"].get("rollout_node", 0)}
        for n in nodes
    ],
}))
"""

# A rollout-node task that is running when its node dies: Ray retries it once a node with the resource joins.
FAILOVER_DRIVER = r"""
import json, os, sys, time, ray
from opentinker.infra.ray_runtime import ensure_ray

ensure_ray()
marker = sys.argv[1]

@ray.remote(num_cpus=1, resources={"rollout_node": 1}, max_retries=3)
def long_rollout(marker):
    node = ray.get_runtime_context().get_node_id()
    with open(marker, "a") as f:
        f.write(node + "\n")
    time.sleep(8)
    return node

print(json.dumps({"task_node": ray.get(long_rollout.remote(marker), timeout=400)}))
"""


def _cli(data_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OPENTINKER_DATA_DIR": str(data_dir), "COLUMNS": "200"}
    return subprocess.run(
        [str(Path(sys.executable).parent / "opentinker"), "cluster", *args],
        env=env,
        text=True,
        capture_output=True,
        timeout=900,
    )


def _run_driver(address: str) -> dict:
    env = {**os.environ, "OPENTINKER_RAY_ADDRESS": address}
    done = subprocess.run([sys.executable, "-c", DRIVER], env=env, text=True, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_rollout_tasks_run_on_the_worker_node_and_survive_its_replacement(tmp_path):
    data_dir = tmp_path / "data"
    up = _cli(data_dir, "up", "--nodes", "2", "--cpus-per-node", "1", "--object-store-mb", "128")
    cluster = LocalCluster(root=data_dir / "cluster", settings=Settings(data_dir=data_dir))
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        nodes = cluster.nodes()
        assert set(nodes) == {"head", "worker-1"} and all(node.alive() for node in nodes.values())
        env_line = _cli(data_dir, "status", "--env").stdout.strip()
        assert env_line == f"export OPENTINKER_RAY_ADDRESS={cluster.address}"

        result = _run_driver(cluster.address)
        by_port = {node["port"]: node for node in result["nodes"]}
        worker = by_port[nodes["worker-1"].ports["node_manager"]]
        head = by_port[nodes["head"].ports["node_manager"]]
        assert len(result["nodes"]) == 2
        assert worker["rollout"] == 1 and head["rollout"] == 0
        assert result["task_node"] == worker["id"] != head["id"]
        family = [proc for node in nodes.values() for proc in node.family()]
        assert len(family) > 4  # raylet, gcs, agents... per node

        # Lose the worker node mid-task; a replacement joins; the retried task finishes on the new node.
        marker = tmp_path / "attempts.txt"
        driver = subprocess.Popen(
            [sys.executable, "-c", FAILOVER_DRIVER, str(marker)],
            text=True,
            env={**os.environ, "OPENTINKER_RAY_ADDRESS": cluster.address},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 240
        while not marker.exists() and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.5)
        assert marker.read_text().split() == [worker["id"]]
        cluster.stop_node("worker-1")
        replacement = cluster.add_worker(cpus_per_node=1, object_store_mb=128)
        family += replacement.family()
        out, err = driver.communicate(timeout=420)
        assert driver.returncode == 0, err[-3000:]
        attempts = marker.read_text().split()
        final_node = json.loads(out.strip().splitlines()[-1])["task_node"]
        assert attempts[0] == worker["id"] and final_node == attempts[-1] != worker["id"]
        assert set(cluster.nodes()) == {"head", "worker-2"}
        nodes = cluster.nodes()
    finally:
        down = _cli(data_dir, "down")
    assert down.returncode == 0 and "worker-2" in down.stdout and "head" in down.stdout
    assert not any(node.alive() for node in nodes.values())
    assert [proc.pid for proc in family if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE] == []
    assert "no cluster recorded" in _cli(data_dir, "status").stdout
    assert _cli(data_dir, "status", "--env").stdout == ""


def test_bad_node_count_is_rejected(tmp_path):
    with pytest.raises(ClusterError, match="nodes must be >= 1"):
        LocalCluster(root=tmp_path / "cluster", settings=Settings(data_dir=tmp_path)).up(nodes=0)
