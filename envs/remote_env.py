"""``RemoteEnv``: N env copies behind one batched, numpy-only API, stepped in-process or on Ray actors.

Two ways to use it (docs/rl_core.md, "RemoteEnv"): wrap an env (``RemoteEnv("CartPole-v1", parallel=8)``), or
subclass it and write the env in the subclass (``super().__init__(parallel=4)``, spaces set in ``__init__``,
``step``/``reset`` as for one env). A subclass instance is then both the driver-side handle and the template
of its copies: when its ``__init__`` returns, the instance (driver state left out) is cloudpickled, its class by
value when workers could not import it, and every copy is that snapshot behind ``SubclassEnv``.
"""

from __future__ import annotations

import inspect
import itertools
import time
import warnings
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from opentinker.envs.base import EnvLike, after_init, check_spaces, env_name, make_env
from opentinker.envs.errors import EnvAPIWarning, EnvSpecError
from opentinker.envs.observations import concat_obs
from opentinker.envs.remote import RemoteFunction, ship_by_value
from opentinker.envs.rollout import Rollout, RolloutWorker, derive_seed, has_native_vector_env

BACKENDS = ("auto", "local", "ray")
# "auto" picks Ray only when it can pay off: at least AUTO_RAY_MIN_PARALLEL copies of an env that has no
# numpy-vectorised implementation and whose step costs at least AUTO_RAY_MIN_STEP_S (measured on one copy).
# Cheap envs (classic control steps in ~20 us) lose more to inter-process calls than they gain.
AUTO_RAY_MIN_PARALLEL = 16
AUTO_RAY_MIN_STEP_S = 1e-3
ENV_PICKLE_WARN_BYTES = 1 << 20
"""A RemoteEnv subclass instance that pickles to more than this (1 MiB) gets a warning: every copy carries it."""
DRIVER_STATE = ("_pool", "env", "sizes", "single_observation_space", "single_action_space")
"""What a subclass instance holds as the driver-side handle; left out of the copies' template."""
_warned: set[tuple[str, str]] = set()


def warn_once(cls: type, what: str, message: str) -> None:
    """One warning per (class, what) per process."""
    if (cls.__qualname__, what) not in _warned:
        _warned.add((cls.__qualname__, what))
        warnings.warn(message, EnvAPIWarning, stacklevel=3)


def _attr(cls: type, name: str) -> Any:
    """``cls.name`` without binding (a ``RemoteFunction`` stays one)."""
    return next((klass.__dict__[name] for klass in cls.__mro__ if name in klass.__dict__), None)


def _own_method(cls: type, name: str) -> Any:
    """``cls.name`` as a plain function when a RemoteEnv subclass defines it (``@remote`` unwrapped), else None."""
    for klass in cls.__mro__:
        if klass is RemoteEnv:
            return None
        if name in klass.__dict__:
            attr = klass.__dict__[name]
            return attr.fn if isinstance(attr, RemoteFunction) else attr
    return None


class SubclassEnv(gym.Env):
    """One copy of a ``RemoteEnv`` subclass as a gymnasium env: the subclass's own ``reset``/``step`` run here
    (in the worker, never as nested Ray tasks); the old gym 4-tuple is converted to gymnasium's 5-tuple."""

    def __init__(self, instance: RemoteEnv):
        self.instance = instance
        self.observation_space, self.action_space = instance.observation_space, instance.action_space
        self.metadata = getattr(instance, "metadata", {})
        self._reset, self._step = _own_method(type(instance), "reset"), _own_method(type(instance), "step")
        if self._step is None:
            raise EnvSpecError(f"{type(instance).__name__}.step is missing: define step(self, action) for one env copy")

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        super().reset(seed=seed)
        cls = type(self.instance)
        if self._reset is None:
            warn_once(
                cls,
                "reset",
                f"{cls.__name__} defines no reset(): each episode starts from an observation "
                "sampled from observation_space; define reset(self, seed=None, options=None) -> (obs, info)",
            )
            self.observation_space.seed(int(self.np_random.integers(2**31)))
            return self.observation_space.sample(), {}
        params = inspect.signature(self._reset).parameters
        kwargs = {k: v for k, v in (("seed", seed), ("options", options)) if k in params}
        out = self._reset(self.instance, **kwargs)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
            return out
        warn_once(
            cls,
            "reset-old",
            f"{cls.__name__}.reset returned the observation alone (old gym API); return (obs, info) as gymnasium does",
        )
        return out, {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        out = self._step(self.instance, action)
        if isinstance(out, tuple) and len(out) == 4:
            cls = type(self.instance)
            warn_once(
                cls,
                "step-4",
                f"{cls.__name__}.step returned the old gym 4-tuple (obs, reward, done, info); "
                "converted (done with info['TimeLimit.truncated'] -> truncated, else terminated). Return "
                "gymnasium's 5-tuple (obs, reward, terminated, truncated, info) instead",
            )
            obs, reward, done, info = out
            truncated = bool(done) and bool(info.get("TimeLimit.truncated", False))
            return obs, reward, bool(done) and not truncated, truncated, info
        return out

    def close(self) -> None:
        close = _own_method(type(self.instance), "close")
        if close is not None:
            close(self.instance)


class SubclassCopies:
    """Picklable factory of ``SubclassEnv`` copies from a cloudpickled subclass instance (its class by value
    when workers cannot import its module)."""

    def __init__(self, template: bytes, name: str):
        self.template, self.__name__ = template, name

    def __call__(self) -> SubclassEnv:
        import cloudpickle

        return SubclassEnv(cloudpickle.loads(self.template))


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


def resolve_backend(
    env: Any,
    backend: str,
    parallel: int,
    workers: int | None,
    env_kwargs: dict,
    step_seconds: Callable[[], float] | None = None,
) -> str:
    """The backend for ``parallel`` copies of ``env`` on ``workers``: "auto" picks Ray only for
    ``AUTO_RAY_MIN_PARALLEL``+ copies on more than one worker of an env with no numpy-vectorised implementation
    whose step (``step_seconds()``, default ``mean_step_seconds`` of one copy) takes ``AUTO_RAY_MIN_STEP_S`` or more.
    ``RemoteEnv`` and the multi-agent ``RemoteJointEnv`` (a joint step of a PettingZoo env) share this rule."""
    if backend not in BACKENDS:
        raise EnvSpecError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    vectorised = isinstance(env, str) and env in gym.registry and has_native_vector_env(env)
    if vectorised or parallel < AUTO_RAY_MIN_PARALLEL or workers == 1 or isinstance(env, gym.Env):
        return "local"
    seconds = step_seconds() if step_seconds else mean_step_seconds(env, env_kwargs)
    return "ray" if seconds >= AUTO_RAY_MIN_STEP_S else "local"


def worker_sizes(backend: str, parallel: int, workers: int | None) -> list[int]:
    """Copies per worker: ``workers`` given, else one in-process worker, or one Ray actor per cluster CPU."""
    if workers is None and backend == "ray":
        from opentinker.envs.ray_backend import default_workers

        workers = default_workers(parallel)
    return split_envs(parallel, workers or 1)


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


def actor_pool(backend: str, worker_cls: type, per_worker_args: list[tuple]) -> Any:
    """``worker_cls(*args)`` workers as Ray actors (backend "ray": ``RayActorPool``) or in this process."""
    if backend == "ray":
        from opentinker.envs.ray_backend import RayActorPool

        return RayActorPool(worker_cls, per_worker_args)
    return LocalActorPool(worker_cls, per_worker_args)


class LocalPool(LocalActorPool):
    """``RemoteEnv``'s local backend: ``RolloutWorker`` objects in this process."""

    def __init__(self, env: EnvLike, sizes: list[int], seed: int, env_kwargs: dict):
        super().__init__(RolloutWorker, [(env, n, seed, i, env_kwargs) for i, n in enumerate(sizes)])

    def call_one(self, index: int, method: str, *args: Any) -> Any:
        return getattr(self.workers[index], method)(*args)

    def collect(self, weights, spec, n_steps, iteration, state_diff) -> list[tuple[Rollout, bytes | None]]:
        return [w.collect(weights, spec, n_steps, iteration, None, state_diff) for w in self.workers]


class RemoteEnv:
    """``parallel`` copies of ``env`` split over ``workers``; see docs/rl_core.md.

    ``backend="local"`` keeps the copies in this process, ``"ray"`` runs one Ray actor per worker, ``"auto"``
    uses Ray only for 16+ copies of an env without a vectorised implementation whose step takes >= 1 ms (and for
    a subclass whose ``step`` is marked ``@remote``). Env seeds derive from (seed, worker); action noise in
    ``collect`` from (seed, iteration, worker). ``ray_options`` (ray backend) sets the actors' ``num_cpus``,
    ``num_gpus`` (fractions allowed) and custom ``resources`` (placement); without ``num_cpus`` each actor takes
    one CPU or an equal share of the free ones. Without ``env``, the subclass is the env (module docstring).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        after_init(cls, lambda self: None if hasattr(self, "_pool") else self._start_subclass())

    def __init__(
        self,
        env: EnvLike | None = None,
        parallel: int = 8,
        workers: int | None = None,
        backend: str = "auto",
        state_diff: bool = False,
        seed: int = 0,
        validate: bool = True,
        ray_options: dict | None = None,
        **env_kwargs: Any,
    ):
        if not isinstance(parallel, int) or parallel < 1:
            raise EnvSpecError(f"RemoteEnv parallel must be an int >= 1, got {parallel!r}")
        if workers is not None and (not isinstance(workers, int) or not 1 <= workers <= parallel):
            raise EnvSpecError(f"RemoteEnv workers must be an int in [1, parallel={parallel}], got {workers!r}")
        self.num_envs, self.seed, self.state_diff = parallel, seed, state_diff
        self._options = {"workers": workers, "backend": backend, "validate": validate, "ray_options": ray_options}
        if env is not None:
            self._start(env, env_kwargs)
        elif type(self) is RemoteEnv:
            raise EnvSpecError(
                "RemoteEnv env is missing: pass a gymnasium id, env class, factory or instance "
                "(RemoteEnv('CartPole-v1')), or subclass RemoteEnv and define the env in the subclass"
            )
        elif env_kwargs:
            raise EnvSpecError(
                f"{type(self).__name__}: env kwargs {sorted(env_kwargs)} need env=; a RemoteEnv "
                "subclass sets its own attributes in __init__"
            )

    def _start_subclass(self) -> None:
        """The subclass's ``__init__`` has returned: check its spaces, snapshot it, start its copies."""
        import cloudpickle

        cls = type(self)
        check_spaces(self)
        ship_by_value(cls.__module__, cloudpickle)
        state = {k: v for k, v in self.__dict__.items() if k not in DRIVER_STATE}
        template = object.__new__(cls)
        template.__dict__.update(state)
        blob = cloudpickle.dumps(template)
        if len(blob) > ENV_PICKLE_WARN_BYTES:
            warnings.warn(
                f"{cls.__name__} pickles to {len(blob) / 2**20:.1f} MiB "
                f"(over {ENV_PICKLE_WARN_BYTES / 2**20:.0f} MiB): "
                f"every one of its {self.num_envs} copies carries that. Keep large in-memory objects out of the env "
                "class: load them where the copy runs (in reset, or lazily on first use) or put them in the Ray "
                "object store and keep the reference",
                UserWarning,
                stacklevel=3,
            )
        if self._options["backend"] == "auto" and isinstance(_attr(cls, "step"), RemoteFunction):
            self._options["backend"] = "ray"  # @remote on step: the author marked it heavy
        if any(isinstance(_attr(cls, name), RemoteFunction) for name in dir(cls)):
            # The copies' actors reserve no CPU, so the class's own @remote tasks (which do) can always start.
            self._options["ray_options"] = {"num_cpus": 0, **(self._options["ray_options"] or {})}
        self._start(SubclassCopies(blob, cls.__name__), {})

    def _start(self, env: EnvLike, env_kwargs: dict) -> None:
        workers, validate = self._options["workers"], self._options["validate"]
        self.env, self.env_kwargs, self.env_id = env, dict(env_kwargs), env_name(env)
        self.backend = resolve_backend(env, self._options["backend"], self.num_envs, workers, self.env_kwargs)
        self.sizes = worker_sizes(self.backend, self.num_envs, workers)
        if self.backend == "local":
            self._pool = LocalPool(env, self.sizes, self.seed, self.env_kwargs)
        else:
            from opentinker.envs.ray_backend import RayPool

            self._pool = RayPool(env, self.sizes, self.seed, self.env_kwargs, self._options["ray_options"])
        self.single_observation_space, self.single_action_space = self._pool.call("spaces")[0]
        if validate:
            for message in self._pool.call_one(0, "validate"):
                warnings.warn(message, EnvAPIWarning, stacklevel=3)

    def __getstate__(self) -> dict:
        """Pickled (e.g. into a ``@remote`` method's task) without the driver-side pool."""
        return {k: v for k, v in self.__dict__.items() if k != "_pool"}

    @property
    def num_workers(self) -> int:
        return len(self.sizes)

    def reset(self, seed: int | None = None) -> tuple[np.ndarray, dict]:
        seeds = [(None if seed is None else derive_seed(seed, i),) for i in range(self.num_workers)]
        return concat_obs(self._pool.call("reset", seeds)), {}

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict]:
        """Step every copy once (NEXT_STEP autoreset); infos are not gathered across workers."""
        actions = np.asarray(actions)
        if actions.shape[0] != self.num_envs:
            raise ValueError(f"RemoteEnv.step: actions has {actions.shape[0]} rows, expected num_envs={self.num_envs}")
        bounds = np.cumsum([0, *self.sizes])
        parts = self._pool.call("step", [(actions[a:b],) for a, b in itertools.pairwise(bounds)])
        obs = concat_obs([p[0] for p in parts])
        rew, term, trunc = (np.concatenate([p[k] for p in parts]) for k in range(1, 4))
        return obs, rew, term, trunc, {}

    def collect(self, weights: dict[str, np.ndarray], policy_spec: dict, n_steps: int, iteration: int) -> Rollout:
        """Every worker runs ``n_steps`` with a numpy copy of the policy; returns the joined numpy ``Rollout``."""
        if not isinstance(n_steps, int) or n_steps < 1:
            raise ValueError(f"RemoteEnv.collect n_steps must be an int >= 1, got {n_steps!r}")
        start = time.perf_counter()
        parts = [r.decode() for r, _ in self._pool.collect(weights, policy_spec, n_steps, iteration, self.state_diff)]
        rollout = Rollout.concat(parts)
        rollout.wall_s = time.perf_counter() - start
        rollout.occupied_s = rollout.wall_s * (self.num_workers if self.backend == "ray" else 1)  # local: one by one
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

    def __enter__(self) -> RemoteEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"RemoteEnv({self.env_id!r}, parallel={self.num_envs}, workers={self.num_workers}, "
            f"backend={self.backend!r})"
        )
