"""`train_flow` on a multi-node Ray cluster, reached through settings alone: rollout actors on the worker node,
the run survives losing that node when a replacement joins, and it trains exactly what local mode trains."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import numpy as np
import pytest
from fixtures.pipeline import settings_env, small_train_params

from opentinker.infra.cluster import WORKER_RESOURCE, LocalCluster
from opentinker.infra.ray_runtime import ClusterResourceError, learner_device, rollout_actor_options
from opentinker.infra.settings import Settings, get_settings

# A user's script: its only link to the cluster is the environment (OPENTINKER_RAY_ADDRESS, _ROLLOUT_RESOURCE).
# The progress listener is the test's handle: it holds the run once, after the first checkpoint, until told to go on.
DRIVER = r"""
import json, os, sys, time
from pathlib import Path
import ray
from opentinker.flows.params import TrainParams
from opentinker.flows.train import train_flow
from opentinker.infra.settings import get_settings
from opentinker.tracking import progress

handshake, pause_at = Path(sys.argv[1]), int(sys.argv[2])
runs = [TrainParams.model_validate_json(a) for a in sys.argv[3:]]
phase = 0

def hold_once(step, total, metrics):
    paused = handshake / f"paused-{phase}"
    if step >= pause_at and not paused.exists():
        paused.write_text(str(step))
        deadline = time.monotonic() + 400
        while not (handshake / f"resume-{phase}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)

progress.add_listener(hold_once)
result = train_flow(runs[0])
nodes = [{"id": n["NodeID"], "port": n["NodeManagerPort"], "alive": n["Alive"]} for n in ray.nodes()]
print("RESULT " + json.dumps({"result": result.model_dump(), "nodes": nodes}), flush=True)

phase = 1  # the node is lost again and this time no replacement joins: the run must fail, saying why
os.environ["OPENTINKER_ROLLOUT_NODE_TIMEOUT_S"] = "5"
get_settings.cache_clear()
try:
    train_flow(runs[1])
except Exception as exc:
    print("FAILED " + json.dumps({"type": type(exc).__name__, "message": str(exc)}), flush=True)
"""

CHECKPOINT_EVERY = 2048
PAUSE_AT = 3072  # an iteration after the first checkpoint


def _weights(export_dir: Path) -> dict[str, np.ndarray]:
    with np.load(export_dir / "weights.npz") as data:
        return dict(data)


def _wait_for(path: Path, driver: subprocess.Popen, log: Path, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert path.exists(), f"{path.name} never appeared; driver log:\n{log.read_text()[-4000:]}"


@pytest.mark.slow
def test_train_flow_on_a_cluster_uses_the_worker_node_survives_its_loss_and_matches_local_mode(tmp_path):
    from opentinker.flows.train import train_flow
    from opentinker.tasks.train import run_dir

    params = small_train_params(
        seed=3,
        steps=20_480,
        checkpoint_every=CHECKPOINT_EVERY,
        rollout_num_cpus=0.5,
        rollout_num_gpus=0.0,
        model_name="test-cluster-flow",
        run_name="cluster-flow",
    )
    doomed = params.model_copy(update={"steps": 2 * PAUSE_AT, "run_name": "cluster-flow-lost"})
    cluster_data, handshake, out, log = (
        tmp_path / "user-data",
        tmp_path / "handshake",
        tmp_path / "out.txt",
        tmp_path / "driver.log",
    )
    handshake.mkdir()
    cluster = LocalCluster(root=tmp_path / "cluster", settings=Settings(data_dir=tmp_path))
    driver = None
    try:
        address = cluster.up(nodes=2, cpus_per_node=1, object_store_mb=128)
        head_port, lost_port = (cluster.nodes()[name].ports["node_manager"] for name in ("head", "worker-1"))
        env = {
            key: value
            for key, value in os.environ.items()
            if key not in ("RAY_ADDRESS", "OPENTINKER_MLFLOW_TRACKING_URI")
        }
        env.update(
            OPENTINKER_RAY_ADDRESS=address,
            OPENTINKER_ROLLOUT_RESOURCE=WORKER_RESOURCE,
            OPENTINKER_DATA_DIR=str(cluster_data),
            PREFECT_HOME=str(tmp_path / "prefect"),
        )
        with out.open("w") as stdout, log.open("w") as stderr:
            driver = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    DRIVER,
                    str(handshake),
                    str(PAUSE_AT),
                    params.model_dump_json(),
                    doomed.model_dump_json(),
                ],
                env=env,
                text=True,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )

        # Local mode (this process's own Ray, no rollout resource), same seed and config, while the cluster run starts.
        local = train_flow(params.model_copy(update={"run_name": "cluster-flow-local"}))

        _wait_for(handshake / "paused-0", driver, log)
        assert (run_dir(cluster_data, "cluster-flow") / "checkpoints" / "checkpoint.pt").exists()
        cluster.stop_node("worker-1")  # the rollout actors die with it
        (handshake / "resume-0").write_text("go")  # the next collect waits for their restart: no node can host them yet
        replacement = cluster.add_worker(cpus_per_node=1, object_store_mb=128)

        _wait_for(handshake / "paused-1", driver, log)  # the second run, on the replacement node
        cluster.stop_node(replacement.name)
        (handshake / "resume-1").write_text("go")
        assert driver.wait(timeout=300) == 0, log.read_text()[-4000:]
    finally:
        if driver is not None and driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
        cluster.down()

    lines = out.read_text().splitlines()
    report = json.loads(next(line for line in lines if line.startswith("RESULT "))[len("RESULT ") :])
    result, ids = report["result"], {node["port"]: node["id"] for node in report["nodes"]}
    lost, new, head = ids[lost_port], ids[replacement.ports["node_manager"]], ids[head_port]
    tags = mlflow.MlflowClient(f"sqlite:///{cluster_data / 'mlflow.db'}").get_run(result["run_id"]).data.tags
    assert tags["opentinker.rollout_nodes"].split(",") == [lost, lost] and lost != head
    assert tags["opentinker.rollout_nodes_final"].split(",") == [new, new] and new not in (lost, head)
    assert int((handshake / "paused-0").read_text()) < result["global_step"]

    assert result["global_step"] == local.global_step
    expected = _weights(run_dir(get_settings().resolved_data_dir, "cluster-flow-local") / "export")
    actual = _weights(run_dir(cluster_data, "cluster-flow") / "export")
    assert expected.keys() == actual.keys()
    for key in expected:
        np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)
    assert result["eval_mean"] == local.eval_mean

    failure = json.loads(next(line for line in lines if line.startswith("FAILED "))[len("FAILED ") :])
    assert failure["type"] == "ClusterResourceError", failure
    assert "no alive Ray node can host the rollout actors" in failure["message"]
    assert "'rollout_node': 0.001" in failure["message"] and "OPENTINKER_ROLLOUT_NODE_TIMEOUT_S" in failure["message"]


def test_gpu_requests_are_granted_by_ray_or_fail_naming_the_field(ray_session):
    """No GPU here: the learner's and the rollouts' GPU requests fail at once, naming the field; on a GPU machine
    the learner gets the CUDA device Ray assigned."""
    import torch

    gpus = ray_session.cluster_resources().get("GPU", 0)
    if gpus >= 0.5 and torch.cuda.is_available():
        with learner_device(0.5) as device:
            assert device.startswith("cuda:") and torch.zeros(1, device=device).device.type == "cuda"
            assert ray_session.available_resources().get("GPU", 0) <= gpus - 0.5  # held for the learner
    else:
        with pytest.raises(ClusterResourceError, match=r"num_gpus=0\.5: .* has 0 GPU"):
            with learner_device(0.5):
                pass
        with pytest.raises(ClusterResourceError, match=r"rollout_num_gpus=0\.25 .* set rollout_num_gpus=0"):
            rollout_actor_options(num_cpus=0.5, num_gpus=0.25)
    with learner_device(0) as device:
        assert device == "auto"
    assert rollout_actor_options(num_cpus=0.5, num_gpus=0.0) == {"num_cpus": 0.5, "num_gpus": 0.0}
    with settings_env(OPENTINKER_ROLLOUT_RESOURCE="no_such_node"):
        with pytest.raises(ClusterResourceError, match="OPENTINKER_ROLLOUT_RESOURCE='no_such_node': no alive Ray node"):
            rollout_actor_options()
