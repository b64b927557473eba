"""Connect to Ray exactly once per process, where the settings say; Ray resources for rollout actors and the learner.

Starting a *local* node is retried: Ray gives its dashboard agent a hard-coded 15 s and the raylet 30 s
to register (ray-project/ray#65983), which a busy 2-core machine sometimes misses although a second
attempt succeeds. Start-up is the one Ray failure that Ray's own retries (actor restarts, task retries)
cannot cover, so it is retried here, after stopping what the failed attempt left running.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator

from opentinker.infra.cluster import ClusterResourceError
from opentinker.infra.settings import get_settings

START_ATTEMPTS = 3
ROLLOUT_RESOURCE_SHARE = 0.001
"""What each rollout actor takes of ``settings.rollout_resource``: it constrains placement, CPUs bound capacity."""
GPU_LEASE_TIMEOUT_S = 300.0
WATCH_PERIOD_S = 2.0


def ensure_ray() -> None:
    """Start local Ray (all cores, no dashboard) or join ``ray_address``; a no-op when already connected."""
    import ray

    if ray.is_initialized():
        return
    settings = get_settings()
    address = settings.ray_address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
        return
    for attempt in range(1, START_ATTEMPTS + 1):
        before, started = _children(), time.time()
        try:
            ray.init(
                num_cpus=settings.ray_num_cpus, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False
            )
            return
        except Exception as exc:  # ray raises a bare Exception for a node start-up timeout
            if "timed out during startup" not in str(exc) or attempt == START_ATTEMPTS:
                raise
            ray.shutdown()
            _stop([p for p in _children() if p.pid not in {b.pid for b in before}] + _orphaned_agents(started))
            time.sleep(2.0 * attempt)


def rollout_actor_options(num_cpus: float | None = None, num_gpus: float = 0.0) -> dict:
    """Ray options for ``RemoteEnv``'s rollout actors: CPUs/GPUs from ``RunSpec``, placement from the settings.

    Fails at once, naming the setting or field, when no alive node can host them (instead of actors pending forever)
    and no autoscaler may launch one.
    """
    import ray

    from opentinker.infra.autoscale import autoscaling_state

    ensure_ray()
    resource = get_settings().rollout_resource
    nodes = [node for node in ray.nodes() if node["Alive"]]
    eligible = [node for node in nodes if not resource or node["Resources"].get(resource, 0) > 0]
    # With an autoscaler, nodes for pending actors are launched; a request no node type fits fails while waiting.
    autoscaled = not eligible and resource and autoscaling_state() is not None
    if not eligible and not autoscaled:
        raise ClusterResourceError(
            f"OPENTINKER_ROLLOUT_RESOURCE={resource!r}: no alive Ray node advertises it "
            f"(nodes' resources: {[sorted(n['Resources']) for n in nodes]})"
        )
    if (
        num_gpus > 0
        and not autoscaled
        and max(node["Resources"].get("GPU", 0) for node in eligible) < min(num_gpus, 1.0)
    ):
        raise ClusterResourceError(
            f"rollout_num_gpus={num_gpus} but no Ray node that may host rollout actors has a GPU"
            f"{f' (nodes with {resource!r})' if resource else ''}; set rollout_num_gpus=0"
        )
    options: dict = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    if resource:
        options["resources"] = {resource: ROLLOUT_RESOURCE_SHARE}
    return options


@contextlib.contextmanager
def failing_without_rollout_nodes(options: dict, stop: Callable[[], None]) -> Iterator[None]:
    """Turn "no node can host the rollout actors" into a clear error instead of a run that waits forever.

    Ray restarts actors that lost their node as soon as some node can host them, and otherwise keeps them
    pending indefinitely. A thread here checks every few seconds that an alive node has the resources in
    ``options``; after ``settings.rollout_node_timeout_s`` without one it calls ``stop`` (closing the env, so the
    blocked collect raises) and the block raises ``ClusterResourceError`` saying why.
    """
    import ray

    timeout_s, reason = get_settings().rollout_node_timeout_s, []
    need = {"CPU": options.get("num_cpus") or 0, "GPU": options.get("num_gpus") or 0, **options.get("resources", {})}
    done = threading.Event()

    def watch() -> None:
        since = None
        while not done.wait(WATCH_PERIOD_S):
            if any(n["Alive"] and all(n["Resources"].get(k, 0) >= v for k, v in need.items()) for n in ray.nodes()):
                since = None
            elif since is None:
                since = time.monotonic()
            elif time.monotonic() - since >= timeout_s:
                reason.append(
                    f"no alive Ray node can host the rollout actors (they need {need}) and none joined within "
                    f"{timeout_s:g} s (OPENTINKER_ROLLOUT_NODE_TIMEOUT_S); the run stopped. Add such a node "
                    "(e.g. `LocalCluster.add_worker()` or scale the worker group) and resume the run."
                )
                stop()
                return

    thread = threading.Thread(target=watch, name="opentinker-rollout-node-watch", daemon=True)
    thread.start()
    try:
        yield
    except Exception as exc:
        if reason:
            raise ClusterResourceError(reason[0]) from exc
        raise
    finally:
        done.set()
        thread.join()


@contextlib.contextmanager
def learner_device(num_gpus: float) -> Iterator[str]:
    """The torch device of a learner in this process: ``"auto"`` for ``num_gpus == 0``, else the GPU Ray grants.

    The learner runs in the flow's own process, so its GPU must be on this process's Ray node: a zero-CPU actor
    pinned to this node holds ``num_gpus`` (fractions share a GPU) for as long as the block runs, and the device is
    the GPU Ray assigned to it. Ray Client (``ray://``) drivers run outside the cluster and cannot hold a GPU.
    """
    if num_gpus <= 0:
        yield "auto"
        return
    import ray
    from ray.util.client import ray as ray_client
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ensure_ray()
    if ray_client.is_connected():
        raise ClusterResourceError(
            f"num_gpus={num_gpus}: the learner runs in this process, which reaches Ray through "
            "Ray Client (ray://); run the flow on a cluster node (OPENTINKER_RAY_ADDRESS=HOST:PORT)"
        )
    node_id = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    here, total = node["Resources"].get("GPU", 0), ray.cluster_resources().get("GPU", 0)
    if here < num_gpus:
        raise ClusterResourceError(
            f"num_gpus={num_gpus}: the learner runs in this process on Ray node "
            f"{node['NodeManagerAddress']} ({node_id[:12]}), which has {here:g} GPU(s) "
            f"(the whole cluster has {total:g}); run the flow on a GPU node or set num_gpus=0"
        )
    lease = (
        ray.remote(_GpuLease)
        .options(num_cpus=0, num_gpus=num_gpus, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
        .remote()
    )
    try:
        ready, _ = ray.wait([lease.gpu_ids.remote()], timeout=GPU_LEASE_TIMEOUT_S)
        if not ready:
            raise ClusterResourceError(
                f"num_gpus={num_gpus}: no GPU on this node became free within "
                f"{GPU_LEASE_TIMEOUT_S:.0f} s (other Ray work holds them)"
            )
        yield _cuda_device(ray.get(ready[0]))
    finally:
        ray.kill(lease)


class _GpuLease:
    """Holds a GPU reservation on this node for the learner; Ray's assignment says which GPU."""

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(i) for i in ray.get_gpu_ids()]


def _cuda_device(gpu_ids: list[str]) -> str:
    """Ray's GPU ids are the raylet's device ids; this process may see a renumbered subset (CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else None
    if ids is None:
        return f"cuda:{gpu_ids[0]}"
    if gpu_ids[0] not in ids:
        raise ClusterResourceError(
            f"Ray assigned GPU {gpu_ids[0]} but this process sees only CUDA_VISIBLE_DEVICES={visible}"
        )
    return f"cuda:{ids.index(gpu_ids[0])}"


def _children() -> list:
    import psutil

    return psutil.Process(os.getpid()).children(recursive=True)


def _orphaned_agents(since: float) -> list:
    """Agents whose raylet died are re-parented to init; ours hold files in a session dir named after our pid."""
    import psutil

    marker = f"_{os.getpid()}/"
    found = []
    for process in psutil.process_iter(["ppid", "create_time"]):
        try:
            if process.info["ppid"] != 1 or process.info["create_time"] < since - 1:
                continue
            if any(marker in f.path and "/ray/session_" in f.path for f in process.open_files()):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _stop(processes: list) -> None:
    """Terminate, wait, then kill what is left of a half-started node."""
    import psutil

    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=10)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
