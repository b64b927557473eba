"""``GroupTrainer``: every kind of an ``AgentGroup`` trains at the same time on the same joint rollouts.

The group collects one joint rollout per iteration (all kinds acting together), cuts it into one
``Rollout`` per kind, and calls ``update(rollout)`` of that kind's RL-core trainer (``PPO`` /
``DQN``, built from ``EnvSpaces``: no env copies of its own) on its slice, so the RL core's own update,
replay buffer, schedules, metrics and checkpoints run unchanged. The loop (checkpoint cadence, callback, stop)
is the RL core's ``train_loop``. The env copies are an ``envs.multiagent.RemoteJointEnv`` (the env runtime, as
``RemoteEnv`` is for ``Trainer``): with ``backend="ray"`` they are split over Ray actors; noise is drawn per env
copy, so the rollouts are the same as in-process, bit for bit.
The public shape mirrors the RL core's trainers:
``train(steps, callback, checkpoint_dir, checkpoint_every)``, ``evaluate``, ``save``/``load``, ``export``.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from opentinker.agents.checkpoint import atomic_save, load_checkpoint
from opentinker.agents.dqn import DQN
from opentinker.agents.evaluation import EvalResult
from opentinker.agents.export import export_policy
from opentinker.agents.ppo import PPO
from opentinker.agents.trainer import Trainer, check_train_args, torch_threads, train_loop
from opentinker.envs.base import EnvSpaces
from opentinker.envs.joint import JointEnvs, run_episodes
from opentinker.envs.multiagent import RemoteJointEnv
from opentinker.envs.numpy_policy import NumpyPolicy
from opentinker.envs.remote_env import BACKENDS
from opentinker.envs.rollout import Rollout, derive_seed

ENGINE: dict[str, type[Trainer]] = {"PPO": PPO, "DQN": DQN}
# Small MLPs gain nothing from intra-op threads, and two learners sharing a few cores thrash with them.
KIND_DEFAULTS = {"torch_threads": 1}
GroupCallback = Callable[[dict[str, float], int], "bool | None"]


class GroupTrainer:
    """Built by ``AgentGroup.build(env, num_envs, n_steps, seed, device, backend, workers, **env_kwargs)`` (``group``:
    that ``AgentGroup``; not imported here, since its ``build`` imports this module).

    ``global_step`` counts env steps over all env copies (``num_envs * n_steps`` per iteration); each kind's
    RL-core trainer counts its own agent-steps. Frozen kinds (``freeze``) keep acting but are not updated.
    ``backend``: "local" (env copies in this process), "ray" (split over ``workers`` Ray actors; default one
    per CPU of the cluster) or "auto" (``RemoteEnv``'s rule: Ray only for 16+ copies of an env whose joint
    step takes >= 1 ms). Same seed, same rollouts on either backend and any number of workers.
    """

    def __init__(
        self,
        group: Any,
        env: Any,
        num_envs: int = 1,
        n_steps: int = 64,
        seed: int = 0,
        device: str = "auto",
        backend: str = "auto",
        workers: int | None = None,
        **env_kwargs: Any,
    ):
        for name, value in (("num_envs", num_envs), ("n_steps", n_steps)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GroupTrainer {name} must be an int >= 1, got {value!r}")
        if workers is not None and (not isinstance(workers, int) or not 1 <= workers <= num_envs):
            raise ValueError(f"GroupTrainer workers must be an int in [1, num_envs={num_envs}], got {workers!r}")
        if backend not in BACKENDS:
            raise ValueError(f"GroupTrainer backend must be one of {BACKENDS}, got {backend!r}")
        self.group, self.env, self.env_kwargs = group, env, dict(env_kwargs)
        self.num_envs, self.n_steps, self.seed, self.device = num_envs, n_steps, seed, device
        self.env_id = (
            env
            if isinstance(env, str)
            else getattr(env, "metadata", {}).get("name") or getattr(env, "__name__", type(env).__name__)
        )
        self.envs = RemoteJointEnv(
            env, group.kind_of, group.kinds, group.shared_memory, num_envs, seed, backend, workers, **self.env_kwargs
        )
        self.agents = self.envs.agents
        self.observation_spaces, self.action_spaces = self.envs.observation_spaces, self.envs.action_spaces
        self.trainers: dict[str, Trainer] = {}
        for i, kind in enumerate(group.kinds):
            columns = num_envs * len(self.agents[kind])
            self.trainers[kind] = ENGINE[group.policy_mapping[kind]](
                self.kind_spaces(kind),
                seed=derive_seed(seed, i),
                device=device,
                **{**KIND_DEFAULTS, **group.configs[kind], "n_steps": n_steps, "num_envs": columns},
            )
        self.global_step, self.iteration, self.horizon = 0, 0, None
        self.agent_steps = 0  # actions actually taken by living agents, all kinds
        self.frozen: set[str] = set()

    @property
    def backend(self) -> str:
        return self.envs.backend

    @property
    def sizes(self) -> list[int]:
        return self.envs.sizes

    @property
    def workers(self) -> int:
        return self.envs.num_workers

    @property
    def joint(self) -> JointEnvs:
        """The env copies themselves (local backend, one worker: see ``RemoteJointEnv.joint``)."""
        return self.envs.joint

    def kind_spaces(self, kind: str) -> EnvSpaces:
        """What the kind's RL-core trainer knows of the env: a name and the kind's spaces (channel included)."""
        return EnvSpaces(f"{self.env_id}:{kind}", self.observation_spaces[kind], self.action_spaces[kind])

    def env_state(self) -> JointEnvs:
        """All env copies with their state, gathered from the workers into one ``JointEnvs`` (for checkpoints)."""
        return self.envs.get_state()

    def set_env_state(self, joint: JointEnvs) -> None:
        """Hand ``env_state()``'s copies back to the workers, split by this trainer's shard sizes."""
        self.envs.set_state(joint, self.iteration)

    # -- control ------------------------------------------------------------------------------------------------
    def _check_kinds(self, kinds: tuple[str, ...]) -> None:
        unknown = [k for k in kinds if k not in self.trainers]
        if unknown:
            raise ValueError(f"unknown kind(s) {unknown}; kinds in policy_mapping: {self.group.kinds}")

    def freeze(self, *kinds: str) -> None:
        """Stop updating these kinds; they keep acting with their current policy."""
        self._check_kinds(kinds)
        self.frozen |= set(kinds)

    def unfreeze(self, *kinds: str) -> None:
        self._check_kinds(kinds)
        self.frozen -= set(kinds)

    def agents_per_env(self, kind: str) -> int:
        return len(self.agents[kind])

    # -- training -------------------------------------------------------------------------------------------------
    def _set_horizons(self, steps: int) -> None:
        self.horizon = self.horizon or steps
        for kind, t in self.trainers.items():
            if t.horizon is None:
                t.horizon = self.horizon * self.agents_per_env(kind)

    def train(
        self,
        steps: int | float,
        callback: GroupCallback | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
    ) -> dict[str, float]:
        """Train every unfrozen kind until ``global_step >= steps``; metrics of the last iteration.

        Metric names are the RL core's prefixed by the kind (``predator/losses/policy``) plus the group's
        ``charts/sps`` and ``charts/agent_steps_per_s``. ``callback(metrics, global_step)`` returning False stops.
        """
        steps = check_train_args(steps, checkpoint_dir, checkpoint_every)
        self._set_horizons(steps)
        return train_loop(self, self._iterate, steps, callback, checkpoint_dir, checkpoint_every)

    def collect(self) -> tuple[dict[str, Rollout], dict[str, float]]:
        """One joint rollout of ``n_steps`` with every kind's current policy, on the workers (noise from (seed,
        iteration, env copy)): a ``Rollout`` per kind and each kind's share of ended agent-episodes that ended
        by termination (NaN when none ended). Counters do not move: ``train`` does that."""
        weights = {kind: t.policy.numpy_weights() for kind, t in self.trainers.items()}
        specs = {kind: t.rollout_spec() for kind, t in self.trainers.items()}
        return self.envs.collect(weights, specs, self.n_steps, self.iteration)

    def _iterate(self) -> dict[str, float]:
        start = time.perf_counter()
        # 1. One joint rollout with every kind's current policy.
        rollouts, terminated_fraction = self.collect()
        self.global_step += self.num_envs * self.n_steps
        # 2. Each unfrozen kind runs exactly its update on its slice (and counts the iteration).
        metrics: dict[str, float] = {}
        for kind, t in self.trainers.items():
            rollout = rollouts[kind]
            if kind in self.frozen:
                kind_metrics = Trainer.episode_metrics(rollout.episode_returns, rollout.episode_lengths)
            else:
                with torch_threads(t.config.torch_threads):
                    kind_metrics = t.update(rollout)
                t.iteration += 1
                kind_metrics.update(t.amp.metrics())
            if not np.isnan(terminated_fraction[kind]):
                kind_metrics["charts/terminated_fraction"] = terminated_fraction[kind]
            metrics.update({f"{kind}/{name}": value for name, value in kind_metrics.items()})
        elapsed = max(time.perf_counter() - start, 1e-9)
        agent_steps = sum(int(r.valid.sum()) for r in rollouts.values())
        self.agent_steps += agent_steps
        metrics["charts/sps"] = self.num_envs * self.n_steps / elapsed
        metrics["charts/agent_steps_per_s"] = agent_steps / elapsed
        return metrics

    # -- evaluation ------------------------------------------------------------------------------------------------
    def policies(self) -> dict[str, NumpyPolicy]:
        """Each kind's current policy as a numpy forward (what rollouts and exports run)."""
        return {kind: NumpyPolicy(t.spec, t.policy.numpy_weights()) for kind, t in self.trainers.items()}

    def evaluate(self, episodes: int = 10, seed: int = 10_000) -> dict[str, EvalResult]:
        """Deterministic actions for every kind, one episode on each of ``episodes`` env copies."""
        if not isinstance(episodes, int) or episodes < 1:
            raise ValueError(f"evaluate episodes must be an int >= 1, got {episodes!r}")
        joint = self.envs.fresh(episodes, seed)
        try:
            results = run_episodes(joint, self.policies())
        finally:
            for env in joint.envs:
                env.close()
        out = {}
        for kind, rows in results.items():
            out[kind] = EvalResult.of(
                [r for r, _, _ in rows],
                seed=seed,
                mean_length=float(np.mean([n for _, n, _ in rows])),
                terminated_fraction=float(np.mean([t for *_, t in rows])),
            )
        return out

    # -- persistence -------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """One atomic file: every kind's trainer checkpoint, the env copies' state and the group's counters."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".group-") as tmp:
            kinds = {kind: load_checkpoint(t.save(Path(tmp) / f"{kind}.pt")) for kind, t in self.trainers.items()}
        try:
            joint = pickle.dumps(self.env_state())
        except Exception as exc:
            raise ValueError(f"cannot checkpoint the group: its env copies are not picklable ({exc})") from exc
        state = {
            "format": 1,
            "group": _try_pickle(self.group),
            "env": _try_pickle(self.env),
            "env_kwargs": self.env_kwargs,
            "num_envs": self.num_envs,
            "n_steps": self.n_steps,
            "seed": self.seed,
            "backend": self.backend,
            "workers": self.workers,
            "global_step": self.global_step,
            "iteration": self.iteration,
            "horizon": self.horizon,
            "agent_steps": self.agent_steps,
            "frozen": sorted(self.frozen),
            "joint": joint,
            "kinds": kinds,
        }
        return atomic_save(state, path)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        env: Any = None,
        group: Any = None,
        device: str = "auto",
        backend: str | None = None,
        workers: int | None = None,
    ) -> GroupTrainer:
        """Rebuild from ``save``; pass ``env``/``group`` when they could not be pickled (lambdas, local classes).

        ``backend``/``workers`` default to the saved ones; any other split continues with the same rollouts.
        """
        state = load_checkpoint(path)
        for name, given in (("group", group), ("env", env)):
            if given is None and state[name] is None:
                raise ValueError(f"{path}: the {name} could not be pickled at save time; pass {name}= to load()")
        group = group or pickle.loads(state["group"])
        env = env if env is not None else pickle.loads(state["env"])
        if backend is None:
            backend, workers = state.get("backend", "local"), workers or state.get("workers")
        trainer = cls(
            group,
            env,
            num_envs=state["num_envs"],
            n_steps=state["n_steps"],
            seed=state["seed"],
            device=device,
            backend=backend,
            workers=workers,
            **state["env_kwargs"],
        )
        with tempfile.TemporaryDirectory(prefix="opentinker-group-") as tmp:
            for kind, kind_state in state["kinds"].items():
                file = atomic_save(kind_state, Path(tmp) / f"{kind}.pt")
                trainer.trainers[kind] = ENGINE[group.policy_mapping[kind]].load(
                    file, env=trainer.kind_spaces(kind), device=device
                )
        trainer.global_step, trainer.iteration, trainer.horizon = (
            state["global_step"],
            state["iteration"],
            state["horizon"],
        )
        trainer.agent_steps, trainer.frozen = state["agent_steps"], set(state["frozen"])
        trainer.set_env_state(pickle.loads(state["joint"]))
        return trainer

    def export(self, directory: str | os.PathLike, metadata: dict | None = None) -> dict[str, Path]:
        """One policy export per kind under ``directory/<kind>`` (serve any kind's policy on its own)."""
        out = {}
        for kind, t in self.trainers.items():
            meta = {
                **(metadata or {}),
                "kind": kind,
                "agents": self.agents[kind],
                "shared_memory": self.group.shared_memory or "off",
                "policy_mapping": self.group.policy_mapping,
            }
            out[kind] = export_policy(t, Path(directory) / kind, metadata=meta)
        return out

    def close(self) -> None:
        """Close the env copies (and stop the Ray actors holding them)."""
        self.envs.close()


def _try_pickle(obj: Any) -> bytes | None:
    try:
        return pickle.dumps(obj)
    except Exception:  # a lambda or local class: ``load`` then needs it passed in
        return None
