"""Rollout collection: ``Rollout`` (the numpy batch that crosses the wire) and ``RolloutWorker``.

A worker owns a vector of env copies and runs whole segments of ``n_steps`` with a numpy copy of the policy.
The same class runs in-process (local backend) or inside a Ray actor (ray backend), so both produce the same
data for the same seed. Autoreset follows gymnasium's NEXT_STEP mode: the step after an episode ends only
resets its env; ``valid`` is False there and learners skip it. For a step ``t`` that ends an episode,
``obs[t + 1]`` (or ``last_obs``) is the episode's final observation, which is what truncation bootstraps need.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import time
import warnings
from typing import Any

import gymnasium as gym
import numpy as np

from opentinker.envs.atari import is_atari
from opentinker.envs.base import EnvLike, env_spec, make_env
from opentinker.envs.errors import EnvAPIWarning
from opentinker.envs.numpy_policy import NumpyPolicy
from opentinker.envs.observations import Obs, concat_obs, empty_steps, map_obs, obs_nbytes, write_step
from opentinker.envs.state_diff import decode_observations, encode_observations


@dataclasses.dataclass
class Rollout:
    """``n_steps`` x ``num_envs`` transitions, all numpy; time is axis 0, env copy axis 1.

    ``obs`` and ``last_obs`` have the structure of the observation space: an array, or a dict / tuple of arrays (each
    leaf in its own dtype: images stay uint8).
    """

    obs: Obs
    actions: np.ndarray
    logprobs: np.ndarray
    values: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    valid: np.ndarray
    last_obs: Obs
    last_values: np.ndarray
    episode_returns: np.ndarray
    episode_lengths: np.ndarray
    env_step_s: float = 0.0
    policy_s: float = 0.0
    worker_wall_s: float = 0.0
    wall_s: float = 0.0
    occupied_s: float = 0.0
    """Worker time the rollout held, seen from the driver: ``wall_s`` x workers running at once (0: unknown)."""
    started_at: float = 0.0
    """``time.time()`` when the first worker began acting with this rollout's weights."""
    bytes_raw: int = 0
    bytes_sent: int = 0
    payloads: dict[str, bytes] | None = None

    @property
    def num_steps(self) -> int:
        return int(self.rewards.size)

    @classmethod
    def concat(cls, parts: list[Rollout]) -> Rollout:
        """Join the workers' rollouts along the env axis; timings and byte counts add up."""
        if len(parts) == 1:
            return parts[0]
        along_envs = {f: concat_obs([getattr(p, f) for p in parts], axis=1) for f in _STEP_FIELDS}
        return cls(
            **along_envs,
            last_obs=concat_obs([p.last_obs for p in parts]),
            last_values=np.concatenate([p.last_values for p in parts]),
            episode_returns=np.concatenate([p.episode_returns for p in parts]),
            episode_lengths=np.concatenate([p.episode_lengths for p in parts]),
            env_step_s=sum(p.env_step_s for p in parts),
            policy_s=sum(p.policy_s for p in parts),
            worker_wall_s=sum(p.worker_wall_s for p in parts),
            started_at=min(p.started_at for p in parts),
            bytes_raw=sum(p.bytes_raw for p in parts),
            bytes_sent=sum(p.bytes_sent for p in parts),
        )

    def encode(self) -> Rollout:
        """Replace the per-step arrays by state_diff payloads (for the wire); ``decode`` restores them bit-exactly.

        Observations are most of the bytes; actions, rewards and done flags are nearly free once compressed.
        """
        payloads = {f: encode_observations(getattr(self, f)) for f in _STEP_FIELDS}
        sent = self.bytes_sent + sum(len(p) - obs_nbytes(getattr(self, f)) for f, p in payloads.items())
        empty = {f: map_obs(lambda a: np.empty((0,), a.dtype), getattr(self, f)) for f in _STEP_FIELDS}
        return dataclasses.replace(self, **empty, payloads=payloads, bytes_sent=sent)

    def decode(self) -> Rollout:
        if self.payloads is None:
            return self
        arrays = {f: decode_observations(p) for f, p in self.payloads.items()}
        return dataclasses.replace(self, **arrays, payloads=None)


_STEP_FIELDS = ("obs", "actions", "logprobs", "values", "rewards", "terminated", "truncated", "valid")


def has_native_vector_env(env: EnvLike) -> bool:
    """Whether ``env`` is a gymnasium id with a numpy-vectorised implementation (``CartPoleVectorEnv``): many copies
    in one step. Not Atari's: ale-py's vector env preprocesses differently (clipped rewards, fire on reset) from the
    ``AtariPreprocessing`` that single copies, evaluation and serving get (``envs/atari.py``)."""
    if not isinstance(env, str) or ":" in env or is_atari(env):
        return False
    spec = env_spec(env)
    return isinstance(spec.vector_entry_point, str) and "jax" not in spec.vector_entry_point.lower()


def build_vector_env(env: EnvLike, num_envs: int, **env_kwargs: Any) -> gym.vector.VectorEnv:
    """``num_envs`` copies: gymnasium's native vector env when the id has one, else a SyncVectorEnv."""
    if has_native_vector_env(env):
        return gym.make_vec(env, num_envs=num_envs, vectorization_mode="vector_entry_point", **env_kwargs)
    factory = functools.partial(make_env, env, **env_kwargs)
    return gym.vector.SyncVectorEnv([factory] * num_envs, autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)


def derive_seed(*parts: int) -> int:
    """A 32-bit seed that depends on every part (seed, worker, iteration), with no collisions between neighbours."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


class RolloutWorker:
    """``num_envs`` env copies stepped in whole segments; state carries over between iterations.

    ``collect`` depends only on (its env state, weights, iteration): action noise comes from a Generator
    seeded by (seed, iteration, worker). With ``keep_snapshots`` it also returns a pickled snapshot of its env
    state, which the driver hands back on the next call so a restarted worker (fresh process) can resume
    exactly where the dead one stopped.
    """

    def __init__(
        self,
        env: EnvLike,
        num_envs: int,
        seed: int,
        index: int,
        env_kwargs: dict | None = None,
        keep_snapshots: bool = False,
    ):
        self.env, self.env_kwargs = env, dict(env_kwargs or {})
        self.vec = build_vector_env(env, num_envs, **self.env_kwargs)
        self.num_envs, self.seed, self.index = num_envs, seed, index
        self.keep_snapshots = keep_snapshots
        self.reset(derive_seed(seed, index))

    def reset(self, seed: int | None = None) -> np.ndarray:
        self.obs, _ = self.vec.reset(seed=seed)
        self.prev_done = np.zeros(self.num_envs, dtype=bool)
        self.ep_return = np.zeros(self.num_envs, dtype=np.float64)
        self.ep_len = np.zeros(self.num_envs, dtype=np.int64)
        self.next_iteration = 0
        return self.obs

    def step(self, actions: np.ndarray):
        """One gymnasium-vector step (NEXT_STEP autoreset), for the ``RemoteEnv.step`` API."""
        self.obs, reward, term, trunc, info = self.vec.step(actions)
        return self.obs, reward, term, trunc, info

    def spaces(self) -> tuple[gym.Space, gym.Space]:
        return self.vec.single_observation_space, self.vec.single_action_space

    def validate(self) -> list[str]:
        """Run ``validate_env`` on a fresh copy here, where the job will run (raises EnvValidationError); returns
        the ``EnvAPIWarning`` messages it raised, for the driver to show (a Ray worker's warnings stay in its log)."""
        from opentinker.envs.validation import validate_env

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", EnvAPIWarning)
            validate_env(make_env(self.env, **self.env_kwargs))
        for w in caught:
            if not issubclass(w.category, EnvAPIWarning):
                warnings.warn(w.message, stacklevel=2)
        return [str(w.message) for w in caught if issubclass(w.category, EnvAPIWarning)]

    def pid(self) -> int:
        import os

        return os.getpid()

    def close(self) -> None:
        self.vec.close()

    def snapshot(self) -> bytes:
        """cloudpickle: env classes a worker received by value (a RemoteEnv subclass) pickle by value again."""
        import cloudpickle

        state = (self.vec, self.obs, self.prev_done, self.ep_return, self.ep_len, self.next_iteration)
        return cloudpickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)

    def restore(self, snapshot: bytes) -> None:
        self.vec, self.obs, self.prev_done, self.ep_return, self.ep_len, self.next_iteration = pickle.loads(snapshot)

    def collect(
        self,
        weights: dict[str, np.ndarray],
        policy_spec: dict,
        n_steps: int,
        iteration: int,
        snapshot: bytes | None = None,
        state_diff: bool = False,
    ) -> tuple[Rollout, bytes | None]:
        started_at = time.time()
        if snapshot is not None and iteration != self.next_iteration:
            self.restore(snapshot)
        start = time.perf_counter()
        policy = NumpyPolicy(policy_spec, weights)
        rng = np.random.default_rng([self.seed, iteration, self.index])
        n = self.num_envs
        obs = empty_steps(self.obs, n_steps)
        structured = not isinstance(obs, np.ndarray)  # a Dict/Tuple observation: one buffer per part
        rewards, values, logprobs = (np.empty((n_steps, n), np.float32) for _ in range(3))
        terminated, truncated, valid = (np.empty((n_steps, n), bool) for _ in range(3))
        actions = None
        returns, lengths = [], []
        env_s = policy_s = 0.0
        for t in range(n_steps):
            if structured:
                write_step(obs, t, self.obs)
            else:
                obs[t] = self.obs
            t0 = time.perf_counter()
            action, logp, value = policy.sample(self.obs, rng)
            t1 = time.perf_counter()
            self.obs, reward, term, trunc, _ = self.vec.step(policy.env_actions(action))
            t2 = time.perf_counter()
            policy_s += t1 - t0
            env_s += t2 - t1
            if actions is None:
                actions = np.empty((n_steps, *action.shape), dtype=action.dtype)
            actions[t], logprobs[t], values[t], rewards[t] = action, logp, value, reward
            terminated[t], truncated[t], valid[t] = term, trunc, ~self.prev_done
            self.ep_return += np.where(valid[t], reward, 0.0)
            self.ep_len += valid[t]
            done = term | trunc
            if done.any():
                returns.extend(self.ep_return[done].tolist())
                lengths.extend(self.ep_len[done].tolist())
                self.ep_return[done] = 0.0
                self.ep_len[done] = 0
            self.prev_done = done
        last_values = policy.values(self.obs)
        self.next_iteration = iteration + 1
        rollout = Rollout(
            obs=obs,
            actions=actions,
            logprobs=logprobs,
            values=values,
            rewards=rewards,
            terminated=terminated,
            truncated=truncated,
            valid=valid,
            last_obs=map_obs(np.copy, self.obs),
            last_values=last_values,
            episode_returns=np.asarray(returns, np.float64),
            episode_lengths=np.asarray(lengths, np.int64),
            env_step_s=env_s,
            policy_s=policy_s,
            started_at=started_at,
        )
        rollout.bytes_raw = rollout.bytes_sent = sum(
            obs_nbytes(getattr(rollout, f.name))
            for f in dataclasses.fields(Rollout)
            if isinstance(getattr(rollout, f.name), (np.ndarray, dict, tuple))
        )
        if state_diff:
            rollout = rollout.encode()
        rollout.worker_wall_s = time.perf_counter() - start
        return rollout, (self.snapshot() if self.keep_snapshots else None)
