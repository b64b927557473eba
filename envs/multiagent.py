"""Multi-agent env runtime: ``RemoteJointEnv`` spreads ``num_envs`` copies of a PettingZoo parallel env over
``JointWorker`` shards (in-process or Ray actors, see ``envs/ray_backend.RayActorPool``) and joins their rollouts;
the multi-agent ``RemoteEnv`` (same backend rule, same worker split). The stepping itself, and why a rollout does
not depend on the split, is ``envs/joint.py``.
"""

from __future__ import annotations

import copy
import os
import pickle
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from pettingzoo import ParallelEnv

from opentinker.envs.joint import JointEnvs, Shard, collect_shard, join
from opentinker.envs.numpy_policy import NumpyPolicy
from opentinker.envs.remote_env import actor_pool, resolve_backend, worker_sizes
from opentinker.envs.rollout import Rollout


def env_factory(env: Any, **env_kwargs: Any) -> Callable[[], ParallelEnv]:
    """A zero-argument builder of fresh env copies from "pursuit", a ParallelEnv class/factory or instance."""
    if env == "pursuit":
        from opentinker.envs.pursuit import PursuitEnv

        return lambda: PursuitEnv(**env_kwargs)
    if isinstance(env, ParallelEnv):
        if env_kwargs:
            raise ValueError(f"env kwargs {sorted(env_kwargs)} given with an env instance; pass its class instead")
        return lambda: copy.deepcopy(env)
    if callable(env):
        return lambda: env(**env_kwargs)
    raise ValueError(f"env must be 'pursuit', a PettingZoo ParallelEnv (class, factory or instance), got {env!r}")


def mean_joint_step_seconds(make: Callable[[], ParallelEnv], steps: int = 16) -> float:
    """Average wall time of one joint step of one copy, every agent acting at random (resets excluded)."""
    env = make()
    try:
        env.reset(seed=0)
        total = 0.0
        for i in range(steps):
            if not env.agents:
                env.reset(seed=i)
            actions = {a: env.action_space(a).sample() for a in env.agents}
            start = time.perf_counter()
            env.step(actions)
            total += time.perf_counter() - start
        return total / steps
    finally:
        env.close()


class JointWorker:
    """A shard of env copies that collects with numpy policies rebuilt from (weights, specs): in this process
    (local backend) or as a Ray actor (``envs/ray_backend.RayActorPool``). Like the RL core's ``RolloutWorker``, a
    collect given the snapshot its shard returned after the previous iteration restores it first when the worker is
    not where that snapshot left it (a restarted actor), so a retried collect reproduces the same data."""

    def __init__(
        self,
        make: Callable[[], ParallelEnv],
        count: int,
        kind_of: Callable[[str], str],
        kinds: list[str],
        shared_memory: str | None,
        seed: int,
        first: int,
        keep_snapshots: bool = False,
    ):
        self.joint = JointEnvs(make, count, kind_of, kinds, shared_memory, seed, first)
        self.seed, self.keep_snapshots, self.next_iteration = seed, keep_snapshots, 0

    def layout(self) -> tuple[dict[str, list[str]], dict[str, gym.Space], dict[str, gym.Space]]:
        """(agents per kind, observation space per kind with the channel, action space per kind)."""
        return self.joint.agents, self.joint.observation_spaces, self.joint.action_spaces

    def collect(
        self,
        weights: dict[str, dict[str, np.ndarray]],
        specs: dict[str, dict],
        n_steps: int,
        iteration: int,
        snapshot: bytes | None = None,
    ) -> tuple[Shard, bytes | None]:
        if snapshot is not None and iteration != self.next_iteration:
            self.restore(snapshot)
        policies = {kind: NumpyPolicy(specs[kind], weights[kind]) for kind in specs}
        shard = collect_shard(self.joint, policies, n_steps, self.seed, iteration)
        self.next_iteration = iteration + 1
        return shard, (self.snapshot() if self.keep_snapshots else None)

    def snapshot(self) -> bytes:
        return pickle.dumps((self.joint, self.next_iteration), protocol=pickle.HIGHEST_PROTOCOL)

    def restore(self, snapshot: bytes) -> None:
        self.joint, self.next_iteration = pickle.loads(snapshot)

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        for env in self.joint.envs:
            env.close()


class RemoteJointEnv:
    """``num_envs`` copies of a PettingZoo parallel env split over workers (``JointWorker`` shards), collected
    jointly: what ``RemoteEnv`` is to the RL core's ``Trainer``, this is to ``GroupTrainer``. ``backend``: "local",
    "ray" (``workers`` actors; default one per CPU of the cluster) or "auto" (``resolve_backend``'s rule on one
    joint step). Same seed, same rollouts on either backend and any number of workers."""

    def __init__(
        self,
        env: Any,
        kind_of: Callable[[str], str],
        kinds: list[str],
        shared_memory: str | None = None,
        num_envs: int = 1,
        seed: int = 0,
        backend: str = "auto",
        workers: int | None = None,
        **env_kwargs: Any,
    ):
        self.make = env_factory(env, **env_kwargs)
        self.num_envs, self.seed = num_envs, seed
        self._joint_args = (kind_of, kinds, shared_memory)
        self.backend = resolve_backend(
            self.make, backend, num_envs, workers, {}, step_seconds=lambda: mean_joint_step_seconds(self.make)
        )
        self.sizes = worker_sizes(self.backend, num_envs, workers)
        ray = self.backend == "ray"
        firsts = np.cumsum([0, *self.sizes[:-1]])
        args = [(self.make, n, *self._joint_args, seed, int(first), ray) for n, first in zip(self.sizes, firsts)]
        self.pool = actor_pool(self.backend, JointWorker, args)
        # The env snapshot each worker returned after its last collect (Ray: a restarted actor restores it).
        self._snapshots: list[bytes | None] = [None] * len(self.sizes)
        self.agents, self.observation_spaces, self.action_spaces = self.pool.call("layout")[0]

    @property
    def num_workers(self) -> int:
        return len(self.sizes)

    @property
    def joint(self) -> JointEnvs:
        """The env copies themselves, when they live in this process in one shard (local backend, one worker)."""
        if self.backend != "local" or self.num_workers != 1:
            raise RuntimeError(
                f"the env copies are split over {self.num_workers} {self.backend} workers; "
                "GroupTrainer.joint needs backend='local' with workers=1"
            )
        return self.pool.workers[0].joint

    def fresh(self, num_envs: int, seed: int) -> JointEnvs:
        """New in-process copies with the same layout (for evaluation)."""
        return JointEnvs(self.make, num_envs, *self._joint_args, seed)

    def collect(
        self, weights: dict[str, dict[str, np.ndarray]], specs: dict[str, dict], n_steps: int, iteration: int
    ) -> tuple[dict[str, Rollout], dict[str, float]]:
        """``n_steps`` joint steps with numpy copies of each kind's policy: a ``Rollout`` per kind and each kind's
        share of ended agent-episodes that ended by termination (NaN when none ended)."""
        start = time.perf_counter()
        results = self.pool.call(
            "collect", [(snapshot,) for snapshot in self._snapshots], broadcast=(weights, specs, n_steps, iteration)
        )
        self._snapshots = [snapshot for _, snapshot in results]
        rollouts, terminated_fraction = join([shard for shard, _ in results])
        for rollout in rollouts.values():
            rollout.wall_s = time.perf_counter() - start
        return rollouts, terminated_fraction

    def get_state(self) -> JointEnvs:
        """All env copies with their state, gathered from the workers into one ``JointEnvs`` (for checkpoints)."""
        snapshots = self._snapshots if None not in self._snapshots else self.pool.call("snapshot")
        return JointEnvs.merge([pickle.loads(snapshot)[0] for snapshot in snapshots])

    def set_state(self, joint: JointEnvs, iteration: int) -> None:
        """Hand ``get_state()``'s copies back to the workers, split by this pool's shard sizes; ``iteration`` is
        the next one to collect."""
        if joint.num_envs != self.num_envs:
            raise ValueError(
                f"env state holds {joint.num_envs} env copies; this GroupTrainer has num_envs={self.num_envs}"
            )
        snapshots = [pickle.dumps((part, iteration)) for part in joint.split(self.sizes)]
        self.pool.call("restore", [(snapshot,) for snapshot in snapshots])
        if self.backend == "ray":
            self._snapshots = snapshots

    def worker_pids(self) -> list[int]:
        return self.pool.call("pid")

    def close(self) -> None:
        """Close the env copies (and stop the Ray actors holding them)."""
        self.pool.close()
