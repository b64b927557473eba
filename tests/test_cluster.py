"""`opentinker cluster up|status|down`: separate raylets on loopback, placement observable by node id."""
from __future__ import annotations

import json
import os
import subprocess
import sys
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
    "nodes": [{"id": n["NodeID"], "port": n["NodeManagerPort"], "rollout": n["Resources"].get("rollout_node", 0)} for n in nodes],
}))
"""


def _cli(data_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OPENTINKER_DATA_DIR": str(data_dir), "COLUMNS": "200"}
    return subprocess.run([str(Path(sys.executable).parent / "opentinker"), "cluster", *args], env=env, text=True,
                          capture_output=True, timeout=900)


def _run_driver(address: str) -> dict:
    env = {**os.environ, "OPENTINKER_RAY_ADDRESS": address}
    done = subprocess.run([sys.executable, "-c", DRIVER], env=env, text=True, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_two_node_cluster_places_rollout_tasks_on_the_worker_node(tmp_path):
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
    finally:
        down = _cli(data_dir, "down")
    assert down.returncode == 0 and "worker-1" in down.stdout and "head" in down.stdout
    assert not any(node.alive() for node in nodes.values())
    assert [proc.pid for proc in family if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE] == []
    assert "no cluster recorded" in _cli(data_dir, "status").stdout
    assert _cli(data_dir, "status", "--env").stdout == ""


def test_bad_node_count_is_rejected(tmp_path):
    with pytest.raises(ClusterError, match="nodes must be >= 1"):
        LocalCluster(root=tmp_path / "cluster", settings=Settings(data_dir=tmp_path)).up(nodes=0)
