"""What PPO and DQN trainers share: env and device setup, the train loop with callbacks and checkpoints,
evaluation with the numpy policy, and bit-exact save/load."""
from __future__ import annotations

import dataclasses
import os
import pickle
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import gymnasium as gym
import numpy as np
import torch

from opentinker.agents.amp import AmpController
from opentinker.agents.checkpoint import CHECKPOINT_NAME, atomic_save, load_checkpoint, restore_rng_state, rng_state
from opentinker.agents.config import EnvConfig
from opentinker.agents.numpy_policy import NumpyPolicy
from opentinker.envs.remote_env import RemoteEnv
from opentinker.envs.rollout import build_vector_env

Callback = Callable[[dict[str, float], int], "bool | None"]


class EvalResult(NamedTuple):
    mean: float
    std: float
    returns: list[float]


def resolve_device(device: str | torch.device) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} requested but CUDA is not available; use device='auto' or 'cpu'")
    return device


class Trainer:
    """Subclasses set ``algorithm``/``config_cls``/``value_based`` and implement ``_build`` and ``_iterate``."""

    algorithm: str
    config_cls: type[EnvConfig]
    value_based: bool

    def __init__(self, env: Any, policy: str = "MLP", seed: int = 0, device: str = "auto", amp_mode: str = "off",
                 **config: Any):
        if policy != "MLP":
            raise ValueError(f"policy must be 'MLP' (the only architecture so far), got {policy!r}")
        fields = {f.name for f in dataclasses.fields(self.config_cls)}
        unknown = sorted(set(config) - fields)
        if unknown:
            raise ValueError(f"unknown {self.config_cls.__name__} field(s) {unknown}; valid fields: {sorted(fields)}")
        self.config = self.config_cls(**config)
        self.seed, self.device = seed, resolve_device(device)
        if isinstance(env, RemoteEnv):
            self.env = env
            self.config.num_envs = env.num_envs
        else:
            self.env = RemoteEnv(env, parallel=self.config.num_envs, workers=self.config.workers,
                                 backend=self.config.backend, state_diff=self.config.state_diff, seed=seed)
        self.env_id = self.env.env_id
        torch.manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.amp = AmpController(amp_mode, self.device)
        self.global_step, self.iteration, self.horizon = 0, 0, self.config.total_steps
        self._build()

    # -- subclass hooks -------------------------------------------------------------------------------------
    def _build(self) -> None:
        raise NotImplementedError

    def _iterate(self) -> dict[str, float]:
        """Collect one rollout, update, return the iteration's metrics."""
        raise NotImplementedError

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    # -- training ---------------------------------------------------------------------------------------------
    def train(self, steps: int, callback: Callback | None = None, checkpoint_dir: str | os.PathLike | None = None,
              checkpoint_every: int | None = None) -> dict[str, float]:
        """Train until ``global_step >= steps`` (so a resumed trainer continues); metrics of the last iteration.

        ``callback(metrics, global_step)`` runs once per iteration; returning False stops. With
        ``checkpoint_dir``, ``checkpoint.pt`` there is rewritten every ``checkpoint_every`` env steps and at the end.
        """
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"train steps must be an int >= 1, got {steps!r}")
        if checkpoint_every is not None and (checkpoint_dir is None or checkpoint_every < 1):
            raise ValueError("checkpoint_every needs a checkpoint_dir and must be >= 1")
        self.horizon = self.horizon or steps
        threads = torch.get_num_threads()
        if self.config.torch_threads:
            torch.set_num_threads(self.config.torch_threads)
        try:
            return self._train_loop(steps, callback, checkpoint_dir, checkpoint_every)
        finally:
            torch.set_num_threads(threads)

    def _train_loop(self, steps: int, callback: Callback | None, checkpoint_dir: str | os.PathLike | None,
                    checkpoint_every: int | None) -> dict[str, float]:
        metrics: dict[str, float] = {}
        next_checkpoint = None if checkpoint_every is None else (self.global_step // checkpoint_every + 1) * checkpoint_every
        start, start_step = time.perf_counter(), self.global_step
        while self.global_step < steps:
            metrics = self._iterate()
            self.iteration += 1
            metrics["charts/sps"] = (self.global_step - start_step) / max(time.perf_counter() - start, 1e-9)
            metrics.update(self.amp.metrics())
            if next_checkpoint is not None and self.global_step >= next_checkpoint:
                self.save(Path(checkpoint_dir) / CHECKPOINT_NAME)
                next_checkpoint = (self.global_step // checkpoint_every + 1) * checkpoint_every
            if callback is not None and callback(dict(metrics), self.global_step) is False:
                break
        if checkpoint_dir is not None:
            self.save(Path(checkpoint_dir) / CHECKPOINT_NAME)
        return metrics

    @staticmethod
    def episode_metrics(returns: np.ndarray, lengths: np.ndarray) -> dict[str, float]:
        if len(returns) == 0:
            return {}
        return {"charts/episodic_return_mean": float(returns.mean()), "charts/episodic_return_min": float(returns.min()),
                "charts/episodic_return_max": float(returns.max()), "charts/episodic_length": float(lengths.mean()),
                "charts/episodes": float(len(returns))}

    @staticmethod
    def rollout_metrics(rollout: Any) -> dict[str, float]:
        return {"system/rollout_efficiency": rollout.env_step_s / max(rollout.worker_wall_s, 1e-9),
                "system/rollout_bytes": float(rollout.bytes_sent), "system/rollout_bytes_raw": float(rollout.bytes_raw),
                "system/rollout_s": rollout.wall_s, "system/policy_lag": 0.0}

    # -- evaluation ---------------------------------------------------------------------------------------------
    def numpy_policy(self) -> NumpyPolicy:
        return NumpyPolicy(self.spec, self.policy.numpy_weights())

    def evaluate(self, episodes: int = 10, seed: int = 10_000) -> EvalResult:
        """Mean/std return of ``episodes`` deterministic episodes, one per env copy, seeded by ``seed``."""
        policy = self.numpy_policy()
        vec = build_vector_env(self.env.env, episodes, **self.env.env_kwargs)
        try:
            obs, _ = vec.reset(seed=seed)
            returns, finished = np.zeros(episodes), np.zeros(episodes, dtype=bool)
            while not finished.all():
                obs, reward, term, trunc, _ = vec.step(policy.env_actions(policy.sample(obs, None, True)[0]))
                returns += np.where(finished, 0.0, reward)
                finished |= term | trunc
        finally:
            vec.close()
        return EvalResult(float(returns.mean()), float(returns.std()), returns.tolist())

    # -- persistence ------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Everything needed to continue bit-exactly: weights, optimiser, counters, RNGs, env state, extras."""
        env_ref = self.env.env
        if not isinstance(env_ref, str):
            try:
                env_ref = pickle.dumps(env_ref)
            except Exception:  # a lambda or local class: ``load`` then needs ``env=``
                env_ref = None
        state = {
            "format": 1, "algorithm": self.algorithm, "config": dataclasses.asdict(self.config), "seed": self.seed,
            "amp_mode": self.amp.mode, "env": env_ref,
            "env_args": {"parallel": self.env.num_envs, "workers": self.env.num_workers, "backend": self.env.backend,
                         "state_diff": self.env.state_diff, "seed": self.env.seed, **self.env.env_kwargs},
            "policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
            "global_step": self.global_step, "iteration": self.iteration, "horizon": self.horizon,
            "rng": rng_state(self.rng), "env_state": self.env.get_state(), "amp": self.amp.state_dict(),
            "extra": self._extra_state(),
        }
        return atomic_save(state, path)

    @classmethod
    def load(cls, path: str | os.PathLike, env: Any = None, device: str = "auto") -> "Trainer":
        """Rebuild a trainer from ``save``; ``env`` (id, class or RemoteEnv) overrides the saved env."""
        state = load_checkpoint(path)
        if state["algorithm"] != cls.algorithm:
            raise ValueError(f"{path} holds a {state['algorithm']} checkpoint, not {cls.algorithm}")
        if env is None:
            if state["env"] is None:
                raise ValueError(f"{path}: the env could not be pickled at save time; pass env= to load()")
            ref = state["env"] if isinstance(state["env"], str) else pickle.loads(state["env"])
            env = RemoteEnv(ref, validate=False, **state["env_args"])
        config = dict(state["config"])
        trainer = cls(env, seed=state["seed"], device=device, amp_mode=state["amp_mode"], **config)
        trainer.policy.load_state_dict(state["policy"])
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.global_step, trainer.iteration, trainer.horizon = state["global_step"], state["iteration"], state["horizon"]
        trainer.amp.load_state_dict(state["amp"])
        trainer._load_extra_state(state["extra"])
        if trainer.env.num_workers == len(state["env_state"]):
            trainer.env.set_state(state["env_state"])
        restore_rng_state(state["rng"], trainer.rng)
        return trainer

    @property
    def observation_space(self) -> gym.Space:
        return self.env.single_observation_space

    @property
    def action_space(self) -> gym.Space:
        return self.env.single_action_space
