"""Ray backend of ``RemoteEnv``: one actor per worker, restarted and retried by Ray when its process dies.

Recovery is exact: every collect hands the worker the env snapshot it returned after the previous iteration.
A live worker ignores it; a restarted one (fresh process, fresh envs) restores it, so the retried collect
produces the same data the dead worker would have. Weights go into the object store once per iteration and
all workers read that one copy.
"""

from __future__ import annotations

from typing import Any

import ray

from opentinker.envs.base import EnvLike
from opentinker.envs.errors import WorkerOutOfMemoryError
from opentinker.envs.rollout import Rollout, RolloutWorker
from opentinker.infra.autoscale import actor_demand, wait_for_actors
from opentinker.infra.ray_runtime import ensure_ray

MAX_RESTARTS = 4  # a worker process may die this many times before the job fails
START_TIMEOUT_S = 300.0  # placing and starting the actors (Ray start-up on a loaded machine included)


OOM_HINT = (
    "enable state_diff=True (observations cross the wire delta-encoded and compressed, and workers keep "
    "less per step) and/or lower parallel (fewer env copies per worker process), or give workers more memory"
)


def gather(refs: list, what: str) -> list:
    """``ray.get(refs)``; a worker that ran out of memory (Python's MemoryError, Ray's memory monitor killing it, or
    the process dying of it) becomes ``WorkerOutOfMemoryError`` with the article's fix."""
    try:
        return ray.get(refs)
    except (MemoryError, ray.exceptions.OutOfMemoryError, ray.exceptions.ActorDiedError) as exc:
        if isinstance(exc, ray.exceptions.ActorDiedError) and "memory" not in str(exc).lower():
            raise
        cause = str(exc).strip().splitlines()[-1][:300]
        raise WorkerOutOfMemoryError(f"OOM on worker during {what}: {cause}. Fix: {OOM_HINT}") from exc


def default_workers(parallel: int) -> int:
    ensure_ray()
    return max(1, min(parallel, int(ray.cluster_resources().get("CPU", 1))))


ACTOR_OPTIONS = ("num_cpus", "num_gpus", "resources", "runtime_env")
"""The Ray options a caller may set for the rollout actors (restarts and spreading stay the pool's own)."""


def worker_cpus(workers: int, resources: dict | None = None) -> float:
    """CPUs each actor reserves: one, or an equal share of what is free, or none when the cluster is full, so
    actors can always be placed (a second RemoteEnv on a busy cluster oversubscribes instead of waiting forever).
    With ``resources`` only the CPUs of nodes advertising them count, since the actors can only go there."""
    free = ray.available_resources().get("CPU", 0.0)
    if resources:
        free = min(
            free,
            sum(
                n["Resources"].get("CPU", 0.0)
                for n in ray.nodes()
                if n["Alive"] and all(n["Resources"].get(k, 0) >= v for k, v in resources.items())
            ),
        )
    share = free / workers
    return min(1.0, share) if share >= 0.01 else 0.0


class RayActorPool:
    """One actor per entry of ``per_worker_args`` (``worker_cls(*args)``), restarted by Ray when its process dies;
    calls fan out and gather in order. ``worker_cls`` needs a ``pid()`` method (used to wait until all are up).
    Used as is for rollouts that are not a gymnasium ``RemoteEnv`` (the multi-agent ``JointWorker``)."""

    def __init__(self, worker_cls: type, per_worker_args: list[tuple], actor_options: dict | None = None):
        ensure_ray()
        options = {key: value for key, value in (actor_options or {}).items() if value is not None}
        unknown = sorted(set(options) - set(ACTOR_OPTIONS))
        if unknown:
            raise ValueError(f"ray_options: unknown option {unknown[0]!r} (expected any of {ACTOR_OPTIONS})")
        options.setdefault("num_cpus", worker_cpus(len(per_worker_args), options.get("resources")))
        actor_cls = ray.remote(worker_cls).options(
            max_restarts=MAX_RESTARTS, max_task_retries=MAX_RESTARTS, scheduling_strategy="SPREAD", **options
        )
        self.actors = [actor_cls.remote(*args) for args in per_worker_args]
        try:  # an autoscaler that can never place them fails this at once (ClusterResourceError)
            ready = wait_for_actors([a.pid.remote() for a in self.actors], START_TIMEOUT_S, actor_demand(options))
        except BaseException:
            self.close()
            raise
        if len(ready) < len(self.actors):
            self.close()
            raise TimeoutError(
                f"only {len(ready)} of {len(per_worker_args)} Ray workers of {worker_cls.__name__} started "
                f"within {START_TIMEOUT_S:.0f} s ({options['num_cpus']:.2f} CPU each; "
                f"cluster: {ray.cluster_resources()})"
            )
        ray.get(ready)  # a worker whose constructor (e.g. its env) fails raises here, with its own error

    def call(self, method: str, per_worker_args: list[tuple] | None = None, broadcast: tuple = ()) -> list:
        """``method(*broadcast, *args_i)`` on every actor; ``broadcast`` goes into the object store once."""
        shared = [ray.put(value) for value in broadcast]
        args = per_worker_args or [()] * len(self.actors)
        return gather([getattr(a, method).remote(*shared, *x) for a, x in zip(self.actors, args)], method)

    def node_ids(self) -> list[str]:
        return ray.get([a.__ray_call__.remote(_node_id) for a in self.actors])

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []


class RayGang:
    """Actors that work as one (e.g. a torch.distributed group): never restarted (a lost member invalidates the
    group), every call reaches all of them at once, and the first failure fails the call as ``error`` instead of
    waiting on survivors blocked in a collective with the lost one."""

    def __init__(self, worker_cls: type, per_worker_args: list[tuple], actor_options: dict, error: type[Exception]):
        ensure_ray()
        actor_cls = ray.remote(worker_cls).options(max_restarts=0, scheduling_strategy="SPREAD", **actor_options)
        self.actors, self.error = [actor_cls.remote(*args) for args in per_worker_args], error

    def call(self, method: str, per_worker_args: list[tuple] | None = None, broadcast: tuple = ()) -> list:
        """``method(*broadcast, *args_i)`` on every actor at once; ``broadcast`` goes into the object store once."""
        shared = [ray.put(value) for value in broadcast]
        args = per_worker_args or [()] * len(self.actors)
        return self._get([getattr(a, method).remote(*shared, *x) for a, x in zip(self.actors, args)])

    def call_one(self, index: int, method: str, *args: Any) -> Any:
        return self._get([getattr(self.actors[index], method).remote(*args)])[0]

    def _get(self, refs: list) -> list:
        pending = list(refs)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                ray.get(ready[0])
            return ray.get(refs)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as err:
            raise self.error(f"a member of the group failed: {err}") from err

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


def cluster_gpus() -> float:
    ensure_ray()
    return ray.cluster_resources().get("GPU", 0.0)


def this_node() -> tuple[str, bool]:
    """(this process's node IP, whether Ray granted it a GPU): what an actor needs to host a rendezvous."""
    return ray.util.get_node_ip_address(), bool(ray.get_gpu_ids())


class RayPool(RayActorPool):
    """``RemoteEnv``'s workers: ``RolloutWorker`` actors plus the env snapshots that make a restart exact."""

    def __init__(self, env: EnvLike, sizes: list[int], seed: int, env_kwargs: dict, actor_options: dict | None = None):
        options = dict(actor_options or {})
        options.setdefault("runtime_env", env_runtime_env(env))
        super().__init__(RolloutWorker, [(env, n, seed, i, env_kwargs, True) for i, n in enumerate(sizes)], options)
        self.snapshots: list[bytes | None] = [None] * len(sizes)

    def call(self, method: str, per_worker_args: list[tuple] | None = None, broadcast: tuple = ()) -> list:
        if method in ("reset", "step"):
            self.snapshots = [None] * len(self.actors)  # driver-side copies are stale after direct stepping
        elif method == "restore":
            self.snapshots = [x[0] for x in per_worker_args]
        return super().call(method, per_worker_args, broadcast)

    def call_one(self, index: int, method: str, *args: Any) -> Any:
        return gather([getattr(self.actors[index], method).remote(*args)], method)[0]

    def collect(self, weights, spec, n_steps, iteration, state_diff) -> list[tuple[Rollout, bytes | None]]:
        weights_ref = ray.put(weights)
        refs = [
            a.collect.remote(weights_ref, spec, n_steps, iteration, snap, state_diff)
            for a, snap in zip(self.actors, self.snapshots)
        ]
        results = gather(refs, "collect")
        self.snapshots = [snap for _, snap in results]
        return results


def env_runtime_env(env: EnvLike) -> dict | None:
    """Make a ``module:Class`` env from a source tree importable in the actors: its root goes on their PYTHONPATH
    (Ray ``runtime_env`` ``env_vars``; the nodes must share the path, as on a local Ray). Installed packages
    (site-packages) need nothing; on a multi-node cluster install the package on every node."""
    if not isinstance(env, str) or ":" not in env:
        return None
    import importlib
    import os
    from pathlib import Path

    module_name = env.partition(":")[0]
    path = Path(getattr(importlib.import_module(module_name), "__file__", None) or "")
    if not path.name or any(part in ("site-packages", "dist-packages") for part in path.parts):
        return None
    root = path.parent
    for _ in range(module_name.count(".") + (path.name == "__init__.py")):
        root = root.parent
    paths = [str(root), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(paths)}}


def _node_id(_worker: object) -> str:
    return ray.get_runtime_context().get_node_id()
