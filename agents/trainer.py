"""What PPO and DQN trainers share: env and device setup, the train loop with callbacks and checkpoints,
evaluation with the numpy policy, and bit-exact save/load.

An iteration is two steps: ``collect()`` (a numpy ``Rollout`` from the env copies) and ``update(rollout)`` (the
algorithm's learning step, returning its metrics). ``GroupTrainer`` (agents/multiagent) collects joint rollouts
itself and calls each kind's ``update`` on its slice; it runs the same ``train_loop``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import os
import pickle
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import gymnasium as gym
import numpy as np
import torch

from opentinker.agents.amp import AmpController
from opentinker.agents.checkpoint import CHECKPOINT_NAME, atomic_save, load_checkpoint, restore_rng_state, rng_state
from opentinker.agents.config import TrainerConfig, check_fields
from opentinker.agents.evaluation import EvalResult, evaluate_episodes, policy_act
from opentinker.agents.learners import (
    GradientSync,
    LearnerGroup,
    LearnerGroupError,
    LocalSync,
    learner_group,
    restart_learners,
)
from opentinker.envs.base import EnvSpaces
from opentinker.envs.numpy_policy import NumpyPolicy
from opentinker.envs.remote_env import RemoteEnv
from opentinker.envs.rollout import Rollout

Callback = Callable[[dict[str, float], int], "bool | None"]


class Loopable(Protocol):
    """What ``train_loop`` needs of its owner (an RL-core ``Trainer``, a ``GroupTrainer``, GRPO's trainer)."""

    iteration: int

    def save(self, path: str | os.PathLike) -> Path: ...


def check_train_args(steps: int | float, checkpoint_dir: str | os.PathLike | None, checkpoint_every: int | None) -> int:
    """``steps`` as an int; integral floats (``1e6``, as written in the quickstart article) are accepted."""
    integral = isinstance(steps, numbers.Integral) or (isinstance(steps, numbers.Real) and float(steps).is_integer())
    if isinstance(steps, bool) or not integral or steps < 1:
        raise ValueError(f"train steps must be a whole number >= 1 (an int, or a float such as 1e6), got {steps!r}")
    if checkpoint_every is not None and (checkpoint_dir is None or checkpoint_every < 1):
        raise ValueError("checkpoint_every needs a checkpoint_dir and must be >= 1")
    return int(steps)


def train_loop(
    owner: Loopable,
    iterate: Callable[[], dict[str, float]],
    steps: int,
    callback: Callback | None,
    checkpoint_dir: str | os.PathLike | None,
    checkpoint_every: int | None,
    progress: Callable[[], int] | None = None,
) -> dict[str, float]:
    """Iterate until ``progress() >= steps``; metrics of the last iteration. ``progress``: what the budget counts,
    ``owner.global_step`` (env steps) by default (GRPO: its optimiser updates).

    ``callback(metrics, progress())`` runs once per iteration; returning False stops. With ``checkpoint_dir``,
    ``checkpoint.pt`` there is rewritten every ``checkpoint_every`` (in progress units) and at the end.
    """
    progress = progress or (lambda: owner.global_step)
    metrics: dict[str, float] = {}
    next_checkpoint = None if checkpoint_every is None else (progress() // checkpoint_every + 1) * checkpoint_every
    while progress() < steps:
        metrics = iterate()
        owner.iteration += 1
        if next_checkpoint is not None and progress() >= next_checkpoint:
            owner.save(Path(checkpoint_dir) / CHECKPOINT_NAME)
            next_checkpoint = (progress() // checkpoint_every + 1) * checkpoint_every
        if callback is not None and callback(dict(metrics), progress()) is False:
            break
    if checkpoint_dir is not None:
        owner.save(Path(checkpoint_dir) / CHECKPOINT_NAME)
    return metrics


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Torch intra-op threads set to ``threads`` (None: unchanged) for the block, then restored."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def resolve_device(device: str | torch.device) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} requested but CUDA is not available; use device='auto' or 'cpu'")
    return device


class Trainer:
    """Subclasses set ``algorithm``/``config_cls``/``value_based`` and implement ``_build`` and ``update``.

    ``env``: an id, a gym env, a ``RemoteEnv``, or ``EnvSpaces`` (no env copies; ``config.num_envs`` is then the
    number of columns of the rollouts its owner passes to ``update``).
    """

    algorithm: str
    config_cls: type[TrainerConfig]
    value_based: bool
    default_amp_mode = "off"
    """``amp_mode`` when none is given (agents/amp.py)."""
    sync: GradientSync = LocalSync()
    """How ``update`` shares its minibatches and gradients: alone, or all-reduced inside a ``LearnerWorker``."""
    learners: LearnerGroup | None = None
    """With ``num_learners > 1``, the learner processes that run ``update`` while ``train`` runs."""

    def __init__(
        self,
        env: Any,
        policy: str = "MLP",
        seed: int = 0,
        device: str = "auto",
        amp_mode: str | None = None,
        config: TrainerConfig | None = None,
        **fields: Any,
    ):
        """``config``: the typed config to train with (a pipeline run's); ``fields``: config fields over it."""
        if policy != "MLP":
            raise ValueError(
                f"policy must be 'MLP' (MLP heads; the feature extractor follows the observation space: a CNN for "
                f"uint8 images, a combined extractor for Dict/Tuple), got {policy!r}"
            )
        check_fields(self.algorithm, fields)
        if config is not None and not isinstance(config, self.config_cls):
            raise ValueError(f"config: expected a {self.config_cls.__name__}, got {type(config).__name__}")
        if isinstance(env, RemoteEnv) and config is None:
            fields.setdefault("num_envs", env.num_envs)  # unset: the env copies it was given
        self.config = self.config_cls(**fields) if config is None else dataclasses.replace(config, **fields)
        if isinstance(env, RemoteEnv) and self.config.num_envs != env.num_envs:
            raise ValueError(
                f"num_envs={self.config.num_envs} conflicts with the RemoteEnv's num_envs="
                f"{env.num_envs}: give num_envs to RemoteEnv(parallel=...) only"
            )
        self.seed, self.device = seed, resolve_device(device)
        self.env: RemoteEnv | None
        if isinstance(env, EnvSpaces):
            self.env = None
            self.env_id, self._spaces = env.env_id, (env.observation_space, env.action_space)
        else:
            if isinstance(env, RemoteEnv):
                self.env = env
            else:
                self.env = RemoteEnv(
                    env,
                    parallel=self.config.num_envs,
                    workers=self.config.workers,
                    backend=self.config.backend,
                    state_diff=self.config.state_diff,
                    seed=seed,
                )
            self.env_id = self.env.env_id
            self._spaces = (self.env.single_observation_space, self.env.single_action_space)
        torch.manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.amp = AmpController(amp_mode or self.default_amp_mode, self.device)
        self.global_step, self.iteration, self.horizon = 0, 0, self.config.total_steps
        self.weights_applied_at: float | None = None  # time.time() of the last update's last optimiser step
        with torch_threads(self.config.torch_threads):  # initialisation is small ops too (orthogonal init's QRs)
            self._build()

    # -- subclass hooks -------------------------------------------------------------------------------------
    def _build(self) -> None:
        raise NotImplementedError

    def update(self, rollout: Rollout) -> dict[str, float]:
        """The algorithm's learning step on one rollout (counts its env steps); the iteration's metrics."""
        raise NotImplementedError

    def rollout_spec(self) -> dict:
        """The policy spec rollouts for the next update are collected with (DQN adds its epsilon)."""
        return self.spec

    def collect(self) -> Rollout:
        """One rollout of ``n_steps`` per env copy with a numpy copy of the current weights."""
        return self._own_env("collect").collect(
            self.policy.numpy_weights(), self.rollout_spec(), self.config.n_steps, self.iteration
        )

    def _iterate(self) -> dict[str, float]:
        if self.learners is None:
            return self.update(self.collect())
        metrics, weights, self.global_step = self.learners.update(self.collect())
        self.policy.load_state_dict(weights)  # the rollout workers act with learner 0's weights
        return metrics

    def _own_env(self, action: str) -> RemoteEnv:
        if self.env is None:
            raise RuntimeError(
                f"{type(self).__name__} was built from EnvSpaces (no env copies) and cannot {action}: "
                "its owner collects rollouts and calls update(rollout)"
            )
        return self.env

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    # -- training ---------------------------------------------------------------------------------------------
    def train(
        self,
        steps: int | float,
        callback: Callback | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
    ) -> dict[str, float]:
        """Train until ``global_step >= steps`` (so a resumed trainer continues); metrics of the last iteration.

        ``callback(metrics, global_step)`` runs once per iteration; returning False stops. With
        ``checkpoint_dir``, ``checkpoint.pt`` there is rewritten every ``checkpoint_every`` env steps and at the end.
        """
        steps = check_train_args(steps, checkpoint_dir, checkpoint_every)
        self._own_env("train")
        self.horizon = self.horizon or steps
        start, start_step = time.perf_counter(), self.global_step

        def iterate() -> dict[str, float]:
            try:
                metrics = self._iterate()
            except LearnerGroupError:
                restart_learners(self, None if checkpoint_dir is None else Path(checkpoint_dir) / CHECKPOINT_NAME)
                metrics = self._iterate()
            metrics["charts/sps"] = (self.global_step - start_step) / max(time.perf_counter() - start, 1e-9)
            metrics.update(self.amp.metrics())
            return metrics

        with torch_threads(self.config.torch_threads), learner_group(self):
            return train_loop(self, iterate, steps, callback, checkpoint_dir, checkpoint_every)

    @staticmethod
    def episode_metrics(returns: np.ndarray, lengths: np.ndarray) -> dict[str, float]:
        if len(returns) == 0:
            return {}
        return {
            "charts/episodic_return_mean": float(returns.mean()),
            "charts/episodic_return_min": float(returns.min()),
            "charts/episodic_return_max": float(returns.max()),
            "charts/episodic_length": float(lengths.mean()),
            "charts/episodes": float(len(returns)),
        }

    def rollout_metrics(self, rollout: Rollout, updated: bool = True) -> dict[str, float]:
        """The rollout's ``perf/`` metrics; call at the end of ``update`` (``updated``: the weights changed).

        ``rollout_efficiency``: share of the workers' rollout time spent stepping envs and choosing actions; the rest
        is loop bookkeeping, encoding, transfer and waiting on the slowest worker. ``rollout_worker_share``: share
        of that time inside the workers' own loops (the rest is dispatch, transfer and scheduling).
        ``gradient_delay_ms``: from the previous update's last optimiser step to the first env step acting with
        those weights (absent on the first iteration). ``update_ms`` (set by ``update``) is the learner's compute.
        """
        occupied = rollout.occupied_s or rollout.worker_wall_s
        metrics = {
            "perf/rollout_efficiency": (rollout.env_step_s + rollout.policy_s) / max(occupied, 1e-9),
            "perf/rollout_worker_share": min(rollout.worker_wall_s / max(occupied, 1e-9), 1.0),
            "perf/rollout_bytes": float(rollout.bytes_sent),
            "perf/rollout_bytes_raw": float(rollout.bytes_raw),
            "perf/rollout_s": rollout.wall_s,
            "perf/policy_lag": 0.0,
        }
        if self.weights_applied_at is not None and rollout.started_at:
            metrics["perf/gradient_delay_ms"] = max(rollout.started_at - self.weights_applied_at, 0.0) * 1000.0
        if updated:
            self.weights_applied_at = time.time()
        return metrics

    # -- evaluation ---------------------------------------------------------------------------------------------
    def numpy_policy(self) -> NumpyPolicy:
        return NumpyPolicy(self.spec, self.policy.numpy_weights())

    def evaluate(self, episodes: int = 10, seed: int = 10_000, deterministic: bool = True) -> EvalResult:
        """Mean/std return of ``episodes`` episodes, one per env copy, seeded by ``seed``: greedy (the mode of each
        action's distribution, what serving answers), or with ``deterministic=False`` sampled as in training."""
        env = self._own_env("evaluate")
        act = policy_act(self.numpy_policy(), deterministic, seed)
        return evaluate_episodes(env.env, act, episodes, seed, **env.env_kwargs)

    # -- persistence ------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Everything needed to continue bit-exactly: weights, optimiser, counters, RNGs, env state, extras.

        A trainer built from ``EnvSpaces`` saves no env (its owner keeps the env copies); load it with ``env=``.
        """
        if self.learners is not None:
            self.load_learner_state(self.learners.state())
        env_ref = None if self.env is None else self.env.env
        if env_ref is not None and not isinstance(env_ref, str):
            try:
                env_ref = pickle.dumps(env_ref)
            except Exception:  # a lambda or local class: ``load`` then needs ``env=``
                env_ref = None
        state = {
            "format": 1,
            "algorithm": self.algorithm,
            "config": dataclasses.asdict(self.config),
            "seed": self.seed,
            "amp_mode": self.amp.requested,
            "env": env_ref,
            "env_args": None
            if self.env is None
            else {
                "parallel": self.env.num_envs,
                "workers": self.env.num_workers,
                "backend": self.env.backend,
                "state_diff": self.env.state_diff,
                "seed": self.env.seed,
                **self.env.env_kwargs,
            },
            "iteration": self.iteration,
            "env_state": [] if self.env is None else self.env.get_state(),
            **self.learner_state(),
        }
        return atomic_save(state, path)

    @classmethod
    def load(cls, path: str | os.PathLike, env: Any = None, device: str = "auto") -> Trainer:
        """Rebuild a trainer from ``save``; ``env`` (id, class, RemoteEnv or EnvSpaces) overrides the saved env."""
        state = load_checkpoint(path)
        if state["algorithm"] != cls.algorithm:
            raise ValueError(f"{path} holds a {state['algorithm']} checkpoint, not {cls.algorithm}")
        if env is None:
            if state["env"] is None:
                raise ValueError(
                    f"{path}: no env was saved (not picklable, or the trainer had none); pass env= to load()"
                )
            ref = state["env"] if isinstance(state["env"], str) else pickle.loads(state["env"])
            env = RemoteEnv(ref, validate=False, **state["env_args"])
        config = cls.config_cls(**state["config"])
        trainer = cls(env, seed=state["seed"], device=device, amp_mode=state["amp_mode"], config=config)
        trainer.restore(state)
        return trainer

    def restore(self, state: dict[str, Any] | str | os.PathLike) -> None:
        """Continue from a checkpoint (a loaded one or its path): learner state, iteration, env workers' state."""
        state = state if isinstance(state, dict) else load_checkpoint(state)
        self.load_learner_state(state)
        self.iteration = state["iteration"]
        if self.env is not None and self.env.num_workers == len(state["env_state"]):
            self.env.set_state(state["env_state"])

    def learner_state(self) -> dict[str, Any]:
        """What the learner owns (weights, optimiser, step counter, horizon, RNG, AMP, extras): what a learner
        process starts from and hands back; a checkpoint adds the iteration and the env state."""
        return {
            "policy": self.policy.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "global_step": self.global_step,
            "horizon": self.horizon,
            "rng": rng_state(self.rng),
            "amp": self.amp.state_dict(),
            "extra": self._extra_state(),
        }

    def load_learner_state(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.global_step, self.horizon = state["global_step"], state["horizon"]
        self.amp.load_state_dict(state["amp"])
        self._load_extra_state(state["extra"])
        restore_rng_state(state["rng"], self.rng)

    @property
    def observation_space(self) -> gym.Space:
        return self._spaces[0]

    @property
    def action_space(self) -> gym.Space:
        return self._spaces[1]
