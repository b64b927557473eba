"""``RemoteEnv``: N env copies behind one batched, numpy-only API, stepped in-process or on Ray actors."""
from __future__ import annotations

import time
from typing import Any

import gymnasium as gym
import numpy as np

from opentinker.envs.base import EnvLike, env_name, make_env
from opentinker.envs.errors import EnvSpecError
from opentinker.envs.rollout import Rollout, RolloutWorker, derive_seed

BACKENDS = ("auto", "local", "ray")
# "auto" picks Ray only when it can pay off: at least AUTO_RAY_MIN_PARALLEL copies of an env that has no
# numpy-vectorised implementation and whose step costs at least AUTO_RAY_MIN_STEP_S (measured on one copy).
# Cheap envs (classic control steps in ~20 us) lose more to inter-process calls than they gain.
AUTO_RAY_MIN_PARALLEL = 16
AUTO_RAY_MIN_STEP_S = 1e-3


def mean_step_seconds(env: EnvLike, env_kwargs: dict, steps: int = 32) -> float:
    """Average wall time of one step of one copy (random actions, resets excluded)."""
    probe = make_env(env, **env_kwargs)
    try:
        probe.reset(seed=0)
        probe.action_space.seed(0)
        total = 0.0
        for _ in range(steps):
            action = probe.action_space.sample()
            start = time.perf_counter()
            _, _, terminated, truncated, _ = probe.step(action)
            total += time.perf_counter() - start
            if terminated or truncated:
                probe.reset()
        return total / steps
    finally:
        probe.close()


def resolve_backend(env: EnvLike, backend: str, parallel: int, workers: int | None, env_kwargs: dict) -> str:
    if backend not in BACKENDS:
        raise EnvSpecError(f"RemoteEnv backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    vectorised = isinstance(env, str) and env in gym.registry and gym.spec(env).vector_entry_point is not None
    if vectorised or parallel < AUTO_RAY_MIN_PARALLEL or workers == 1 or isinstance(env, gym.Env):
        return "local"
    return "ray" if mean_step_seconds(env, env_kwargs) >= AUTO_RAY_MIN_STEP_S else "local"


def split_envs(parallel: int, workers: int) -> list[int]:
    """Spread ``parallel`` copies over ``workers`` as evenly as possible (first workers get one more)."""
    base, extra = divmod(parallel, workers)
    return [base + (i < extra) for i in range(workers)]


class LocalActorPool:
    """Worker objects in this process (``worker_cls(*args)`` each), called like ``ray_backend.RayActorPool``."""

    def __init__(self, worker_cls: type, per_worker_args: list[tuple]):
        self.workers = [worker_cls(*args) for args in per_worker_args]

    def call(self, method: str, per_worker_args: list[tuple] | None = None, broadcast: tuple = ()) -> list:
        args = per_worker_args or [()] * len(self.workers)
        return [getattr(w, method)(*broadcast, *a) for w, a in zip(self.workers, args)]

    def close(self) -> None:
        for w in self.workers:
            w.close()


class LocalPool(LocalActorPool):
    """``RemoteEnv``'s local backend: ``RolloutWorker`` objects in this process."""

    def __init__(self, env: EnvLike, sizes: list[int], seed: int, env_kwargs: dict):
        super().__init__(RolloutWorker, [(env, n, seed, i, env_kwargs) for i, n in enumerate(sizes)])

    def call_one(self, index: int, method: str, *args: Any) -> Any:
        return getattr(self.workers[index], method)(*args)

    def collect(self, weights, spec, n_steps, iteration, state_diff) -> list[tuple[Rollout, bytes | None]]:
        return [w.collect(weights, spec, n_steps, iteration, None, state_diff) for w in self.workers]


class RemoteEnv:
    """``parallel`` copies of ``env`` split over ``workers``; see docs/engine.md.

    ``backend="local"`` keeps the copies in this process, ``"ray"`` runs one Ray actor per worker, ``"auto"``
    uses Ray only for 16+ copies of an env without a vectorised implementation whose step takes >= 1 ms.
    Env seeds derive from (seed, worker); action noise in ``collect`` from (seed, iteration, worker).
    ``ray_options`` (ray backend) sets the actors' ``num_cpus``, ``num_gpus`` (fractions allowed) and custom
    ``resources`` (placement); without ``num_cpus`` each actor takes one CPU or an equal share of the free ones.
    """

    def __init__(self, env: EnvLike, parallel: int = 8, workers: int | None = None, backend: str = "auto",
                 state_diff: bool = False, seed: int = 0, validate: bool = True, ray_options: dict | None = None,
                 **env_kwargs: Any):
        if not isinstance(parallel, int) or parallel < 1:
            raise EnvSpecError(f"RemoteEnv parallel must be an int >= 1, got {parallel!r}")
        if workers is not None and (not isinstance(workers, int) or not 1 <= workers <= parallel):
            raise EnvSpecError(f"RemoteEnv workers must be an int in [1, parallel={parallel}], got {workers!r}")
        self.env, self.env_kwargs, self.env_id = env, dict(env_kwargs), env_name(env)
        self.backend = resolve_backend(env, backend, parallel, workers, self.env_kwargs)
        self.num_envs, self.seed, self.state_diff = parallel, seed, state_diff
        if self.backend == "local":
            self.sizes = split_envs(parallel, workers or 1)
            self._pool = LocalPool(env, self.sizes, seed, self.env_kwargs)
        else:
            from opentinker.envs.ray_backend import RayPool, default_workers

            self.sizes = split_envs(parallel, workers or default_workers(parallel))
            self._pool = RayPool(env, self.sizes, seed, self.env_kwargs, ray_options)
        self.single_observation_space, self.single_action_space = self._pool.call("spaces")[0]
        if validate:
            self._pool.call_one(0, "validate")

    @property
    def num_workers(self) -> int:
        return len(self.sizes)

    def reset(self, seed: int | None = None) -> tuple[np.ndarray, dict]:
        seeds = [(None if seed is None else derive_seed(seed, i),) for i in range(self.num_workers)]
        return np.concatenate(self._pool.call("reset", seeds)), {}

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict]:
        """Step every copy once (NEXT_STEP autoreset); infos are not gathered across workers."""
        actions = np.asarray(actions)
        if actions.shape[0] != self.num_envs:
            raise ValueError(f"RemoteEnv.step: actions has {actions.shape[0]} rows, expected num_envs={self.num_envs}")
        bounds = np.cumsum([0, *self.sizes])
        parts = self._pool.call("step", [(actions[a:b],) for a, b in zip(bounds[:-1], bounds[1:])])
        obs, rew, term, trunc = (np.concatenate([p[k] for p in parts]) for k in range(4))
        return obs, rew, term, trunc, {}

    def collect(self, weights: dict[str, np.ndarray], policy_spec: dict, n_steps: int, iteration: int) -> Rollout:
        """Every worker runs ``n_steps`` with a numpy copy of the policy; returns the joined numpy ``Rollout``."""
        if not isinstance(n_steps, int) or n_steps < 1:
            raise ValueError(f"RemoteEnv.collect n_steps must be an int >= 1, got {n_steps!r}")
        start = time.perf_counter()
        parts = [r.decode() for r, _ in self._pool.collect(weights, policy_spec, n_steps, iteration, self.state_diff)]
        rollout = Rollout.concat(parts)
        rollout.wall_s = time.perf_counter() - start
        return rollout

    def get_state(self) -> list[bytes]:
        """Every worker's env state (pickled), for checkpoints."""
        return self._pool.call("snapshot")

    def set_state(self, snapshots: list[bytes]) -> None:
        if len(snapshots) != self.num_workers:
            raise ValueError(f"RemoteEnv.set_state: got {len(snapshots)} snapshots for {self.num_workers} workers")
        self._pool.call("restore", [(s,) for s in snapshots])

    def worker_pids(self) -> list[int]:
        return self._pool.call("pid")

    def worker_node_ids(self) -> list[str | None]:
        """The Ray node id of each worker's actor (where the rollouts run); None for in-process workers."""
        return self._pool.node_ids() if self.backend == "ray" else [None] * self.num_workers

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> "RemoteEnv":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteEnv({self.env_id!r}, parallel={self.num_envs}, workers={self.num_workers}, backend={self.backend!r})"
