"""``RayActorPool``: worker objects of any class as Ray actors, for rollouts that are not a gymnasium ``RemoteEnv``
(the multi-agent ``JointWorker``). Placement, restarts and start-up timeout follow ``RemoteEnv``'s Ray backend."""
from __future__ import annotations

import ray

from opentinker.envs.ray_backend import MAX_RESTARTS, START_TIMEOUT_S, default_workers, worker_cpus
from opentinker.infra.ray_runtime import ensure_ray

__all__ = ["RayActorPool", "default_workers"]


class RayActorPool:
    """One actor per entry of ``per_worker_args`` (``worker_cls(*args)``); calls fan out and gather in order.

    ``worker_cls`` must have a ``pid()`` method (used to wait until every actor is up).
    """

    def __init__(self, worker_cls: type, per_worker_args: list[tuple]):
        ensure_ray()
        cpus = worker_cpus(len(per_worker_args))
        actor_cls = ray.remote(worker_cls).options(
            num_cpus=cpus, max_restarts=MAX_RESTARTS, max_task_retries=MAX_RESTARTS, scheduling_strategy="SPREAD")
        self.actors = [actor_cls.remote(*args) for args in per_worker_args]
        ready, _ = ray.wait([a.pid.remote() for a in self.actors], num_returns=len(self.actors), timeout=START_TIMEOUT_S)
        if len(ready) < len(self.actors):
            self.close()
            raise TimeoutError(f"only {len(ready)} of {len(per_worker_args)} Ray workers of {worker_cls.__name__} started "
                               f"within {START_TIMEOUT_S:.0f} s ({cpus:.2f} CPU each; cluster: {ray.cluster_resources()})")
        ray.get(ready)  # a worker whose constructor failed raises here, with its own error

    def call(self, method: str, per_worker_args: list[tuple] | None = None, broadcast: tuple = ()) -> list:
        """``method(*broadcast, *args_i)`` on every actor; ``broadcast`` goes into the object store once."""
        shared = [ray.put(value) for value in broadcast]
        args = per_worker_args or [()] * len(self.actors)
        return ray.get([getattr(a, method).remote(*shared, *x) for a, x in zip(self.actors, args)])

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
