"""An autoscaling Ray cluster on loopback, and what a driver learns from Ray's autoscaler.

``AutoscalingLocalCluster`` starts only a head node with Ray's own autoscaler (v2) driving its fake multi-node
provider: worker nodes advertising ``rollout_node`` are launched (as raylets on this machine) while rollout actors
are pending and terminated after ``idle_timeout_s`` without work, exactly as KubeRay's autoscaler adds and removes
pods of the ``cpu-rollout`` group (``infra/k8s/raycluster.yaml``). ``ray.cluster_utils.AutoscalingCluster`` is not
used: its ``start()`` runs ``ray stop --force`` (every Ray on the machine) and its base config is not in the wheel,
so the provider is named as an external module.

Drivers read the autoscaler's report from the GCS, on any cluster run by the v2 autoscaler (here or KubeRay): that
there is one (``autoscaling_state``: actors may wait for nodes that do not exist yet) and which requests no node
type can ever meet (``wait_for_actors`` fails on those at once, naming the resources).
(``tracking.runs.log_capacity_wait`` records in the run how long it waited for capacity.)
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time

from opentinker.infra.cluster import WORKER_RESOURCE, ClusterError, ClusterResourceError, LocalCluster
from opentinker.infra.files import atomic_write
from opentinker.infra.processes import ServiceError, free_ports

HEAD_TYPE = "ray.head.default"
WORKER_TYPE = "rollout"
FAKE_HEAD_NODE_ID = "f" * 51 + "00000"
"""The fake provider's id for the head (``ray.autoscaler._private.fake_multi_node.node_provider``); workers count up."""
UPDATE_INTERVAL_S = 1
"""Seconds between autoscaler passes (Ray's default 5 s would add up to 5 s to every scale-up and scale-down)."""
CHECK_PERIOD_S = 1.0
DEFAULT_IDLE_TIMEOUT_S = 60.0


class AutoscalingLocalCluster(LocalCluster):
    """A head node whose autoscaler launches up to ``max_workers`` ``rollout_node`` workers on demand."""

    def up_autoscaling(
        self,
        max_workers: int = 4,
        cpus_per_node: int = 1,
        object_store_mb: int = 512,
        idle_timeout_s: float = 60.0,
        timeout: float = 180.0,
    ) -> str:
        """Start the head with the autoscaler; returns the cluster address. Workers start at zero."""
        if max_workers < 1:
            raise ClusterError(f"max_workers must be >= 1, got {max_workers}")
        if cpus_per_node < 1:
            raise ClusterError(f"cpus_per_node must be >= 1, got {cpus_per_node}")
        if idle_timeout_s <= 0:
            raise ClusterError(f"idle_timeout_s must be > 0, got {idle_timeout_s}")
        if any(node.alive() for node in self.nodes().values()):
            raise ClusterError(
                f"a cluster from {self.state_path} is still running; run `opentinker cluster down` first."
            )
        gcs_port = free_ports(1)[0]
        address = f"127.0.0.1:{gcs_port}"
        config_path = self.root / "autoscaler.json"
        config = autoscaler_config(address, max_workers, cpus_per_node, object_store_mb, idle_timeout_s)
        atomic_write(config_path, json.dumps(config, indent=2))
        env = {
            "RAY_FAKE_CLUSTER": "1",
            "RAY_enable_autoscaler_v2": "1",
            "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_NODE_ID,
            "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID,
            "AUTOSCALER_UPDATE_INTERVAL_S": str(UPDATE_INTERVAL_S),
        }
        temp_dir = tempfile.mkdtemp(prefix="otray-", dir="/tmp")
        try:
            head = self._start_node(
                "head",
                None,
                cpus_per_node,
                object_store_mb,
                temp_dir,
                timeout,
                extra_args=[f"--autoscaling-config={config_path}"],
                env=env,
                gcs_port=gcs_port,
            )
        except BaseException as exc:
            shutil.rmtree(temp_dir, ignore_errors=True)
            if isinstance(exc, ServiceError):
                raise ClusterError(str(exc)) from exc
            raise
        state = {"nodes": {"head": head.to_dict()}, "temp_dir": temp_dir, "next_worker": 1, "autoscale": True}
        self._write_state(state)
        return address


def start_cluster(
    cluster: LocalCluster,
    nodes: int,
    cpus_per_node: int = 1,
    object_store_mb: int = 512,
    timeout: float = 180.0,
    autoscale: bool = False,
    idle_timeout_s: float | None = None,
) -> str:
    """``opentinker cluster up`` into ``cluster``'s root: ``nodes`` fixed nodes, or with ``autoscale`` (or
    ``cluster_idle_timeout_s`` > 0 in the settings) a head whose autoscaler runs up to ``nodes - 1`` workers, each
    removed after ``idle_timeout_s`` idle (default: the setting, else ``DEFAULT_IDLE_TIMEOUT_S``); returns the
    address."""
    settings = cluster.settings
    if not (autoscale or settings.cluster_idle_timeout_s > 0):
        return cluster.up(nodes=nodes, cpus_per_node=cpus_per_node, object_store_mb=object_store_mb, timeout=timeout)
    if nodes < 2:
        raise ClusterError(f"nodes must be >= 2 with autoscaling (the most nodes, head included), got {nodes}")
    idle = idle_timeout_s or settings.cluster_idle_timeout_s or DEFAULT_IDLE_TIMEOUT_S
    autoscaling = AutoscalingLocalCluster(cluster.root, cluster.settings)
    return autoscaling.up_autoscaling(nodes - 1, cpus_per_node, object_store_mb, idle, timeout)


def autoscaler_config(
    address: str, max_workers: int, cpus_per_node: int, object_store_mb: int, idle_timeout_s: float
) -> dict:
    """Ray cluster-launcher config for the fake multi-node provider: the head at ``address``, and one worker type
    offering ``rollout_node`` (launched on demand, terminated after ``idle_timeout_s`` idle)."""
    return {
        "cluster_name": "opentinker-local",
        "max_workers": max_workers,
        "provider": {
            # = type "fake_multinode", whose defaults file (example.yaml) the Ray wheel does not ship
            "type": "external",
            "module": "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "launch_multiple": True,
            "head_node_id": FAKE_HEAD_NODE_ID,
            "gcs_address": address,  # else its workers join 6379, whoever runs there
        },
        "available_node_types": {
            HEAD_TYPE: {"resources": {"CPU": cpus_per_node}, "node_config": {}, "max_workers": 0},
            WORKER_TYPE: {
                "resources": {
                    "CPU": cpus_per_node,
                    WORKER_RESOURCE: 1,
                    "object_store_memory": object_store_mb * 1024 * 1024,
                },
                "node_config": {},
                "min_workers": 0,
                "max_workers": max_workers,
            },
        },
        "head_node_type": HEAD_TYPE,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": idle_timeout_s / 60.0,
        "docker": {},
        "auth": {"ssh_user": "ubuntu"},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


def autoscaling_state():
    """What Ray's autoscaler (v2) last reported to the GCS of the connected cluster, or None: no autoscaler (a
    fixed cluster, local Ray, the v1 autoscaler) or a Ray Client driver (``ray://``), which cannot reach the GCS."""
    import ray
    from ray.autoscaler.v2.sdk import GcsClient, GetClusterStatusReply
    from ray.util.client import ray as ray_client

    if not ray.is_initialized() or ray_client.is_connected():
        return None
    reply = GetClusterStatusReply()
    reply.ParseFromString(GcsClient(ray.get_runtime_context().gcs_address).get_cluster_status(timeout_s=10))
    state = reply.autoscaling_state
    return state if state.autoscaler_state_version else None


def infeasible_requests() -> list[dict[str, float]]:
    """Resource requests the autoscaler reports that no node type it may launch can ever satisfy."""
    state = autoscaling_state()
    return [dict(request.resources_bundle) for request in state.infeasible_resource_requests] if state else []


def actor_demand(options: dict) -> dict[str, float]:
    """The resource bundle Ray schedules an actor with these options by (zero amounts are left out, as Ray does)."""
    demand = {"CPU": options.get("num_cpus") or 0, "GPU": options.get("num_gpus") or 0, **options.get("resources", {})}
    return {key: float(value) for key, value in demand.items() if value}


def wait_for_actors(refs: list, timeout: float, demand: dict[str, float]) -> list:
    """``ray.wait`` for all ``refs`` (the actors' first calls) up to ``timeout``; returns the ready ones.

    While they are pending, a request shaped ``demand`` that the autoscaler reports infeasible fails at once with
    ``ClusterResourceError`` naming the resources, instead of waiting out the timeout for nodes that never come.
    """
    import ray

    deadline = time.monotonic() + timeout
    while True:
        ready, pending = ray.wait(
            refs, num_returns=len(refs), timeout=max(0.0, min(CHECK_PERIOD_S, deadline - time.monotonic()))
        )
        if not pending or time.monotonic() >= deadline:
            return ready
        if any(_same_bundle(request, demand) for request in infeasible_requests()):
            names = {"CPU": "rollout_num_cpus", "GPU": "rollout_num_gpus"}
            asked = ", ".join(
                f"{key}: {value:g} ({names.get(key, 'OPENTINKER_ROLLOUT_RESOURCE')})" for key, value in demand.items()
            )
            raise ClusterResourceError(
                f"the Ray autoscaler reports the rollout actors' request infeasible: no node type it may launch "
                f"offers {asked} on one node; lower rollout_num_cpus/rollout_num_gpus or add a node type that has them"
            )


def _same_bundle(request: dict[str, float], demand: dict[str, float]) -> bool:
    return request.keys() == demand.keys() and all(abs(request[key] - demand[key]) < 1e-4 for key in demand)
