"""``GroupTrainer``: every kind of an ``AgentGroup`` trains at the same time on the same joint rollouts.

The group collects one joint rollout per iteration (all kinds acting together), cuts it into one engine
``Rollout`` per kind, and calls ``update(rollout)`` of that kind's engine trainer (``PPOTrainer`` /
``DQNTrainer``, built from ``EnvSpaces``: no env copies of its own) on its slice, so the engine's own update,
replay buffer, schedules, metrics and checkpoints run unchanged. The loop (checkpoint cadence, callback, stop)
is the engine's ``train_loop``. The public shape mirrors the engine's trainers:
``train(steps, callback, checkpoint_dir, checkpoint_every)``, ``evaluate``, ``save``/``load``, ``export``.
"""
from __future__ import annotations

import os
import pickle
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np

from opentinker.agents.checkpoint import atomic_save, load_checkpoint
from opentinker.agents.dqn import DQNTrainer
from opentinker.agents.export import export_policy
from opentinker.agents.multiagent.group import AgentGroup
from opentinker.agents.multiagent.rollout import JointEnvs, collect, env_factory, run_episodes
from opentinker.agents.numpy_policy import NumpyPolicy
from opentinker.agents.ppo import PPOTrainer
from opentinker.agents.trainer import EnvSpaces, Trainer, check_train_args, torch_threads, train_loop
from opentinker.envs.rollout import derive_seed

ENGINE: dict[str, type[Trainer]] = {"PPO": PPOTrainer, "DQN": DQNTrainer}
# Small MLPs gain nothing from intra-op threads, and two learners sharing a few cores thrash with them.
KIND_DEFAULTS = {"torch_threads": 1}
GroupCallback = Callable[[dict[str, float], int], "bool | None"]


class KindEvalResult(NamedTuple):
    """The engine's ``EvalResult`` fields per agent-episode of one kind, plus lengths and termination share."""

    mean: float
    std: float
    returns: list[float]
    mean_length: float
    terminated_fraction: float


class GroupTrainer:
    """Built by ``AgentGroup.build(env, num_envs, n_steps, seed, device, **env_kwargs)``.

    ``global_step`` counts env steps over all env copies (``num_envs * n_steps`` per iteration); each kind's
    engine trainer counts its own agent-steps. Frozen kinds (``freeze``) keep acting but are not updated.
    """

    def __init__(self, group: AgentGroup, env: Any, num_envs: int = 1, n_steps: int = 64, seed: int = 0,
                 device: str = "auto", **env_kwargs: Any):
        for name, value in (("num_envs", num_envs), ("n_steps", n_steps)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GroupTrainer {name} must be an int >= 1, got {value!r}")
        self.group, self.env, self.env_kwargs = group, env, dict(env_kwargs)
        self.num_envs, self.n_steps, self.seed, self.device = num_envs, n_steps, seed, device
        self.env_id = env if isinstance(env, str) else getattr(env, "metadata", {}).get("name") or getattr(
            env, "__name__", type(env).__name__)
        self.joint = self._joint(num_envs, seed)
        self.trainers: dict[str, Trainer] = {}
        for i, kind in enumerate(group.kinds):
            columns = num_envs * len(self.joint.agents[kind])
            self.trainers[kind] = ENGINE[group.policy_mapping[kind]](
                self.kind_spaces(kind), seed=derive_seed(seed, i), device=device,
                **{**KIND_DEFAULTS, **group.configs[kind], "n_steps": n_steps, "num_envs": columns})
        self.global_step, self.iteration, self.horizon = 0, 0, None
        self.agent_steps = 0  # actions actually taken by living agents, all kinds
        self.frozen: set[str] = set()

    def kind_spaces(self, kind: str) -> EnvSpaces:
        """What the kind's engine trainer knows of the env: a name and the kind's spaces (channel included)."""
        return EnvSpaces(f"{self.env_id}:{kind}", self.joint.observation_spaces[kind], self.joint.action_spaces[kind])

    def _joint(self, num_envs: int, seed: int) -> JointEnvs:
        return JointEnvs(env_factory(self.env, **self.env_kwargs), num_envs, self.group.kind_of, self.group.kinds,
                         self.group.shared_memory, seed)

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
        return len(self.joint.agents[kind])

    # -- training -------------------------------------------------------------------------------------------------
    def _set_horizons(self, steps: int) -> None:
        self.horizon = self.horizon or steps
        for kind, t in self.trainers.items():
            if t.horizon is None:
                t.horizon = self.horizon * self.agents_per_env(kind)
                per_iteration = self.num_envs * self.n_steps * self.agents_per_env(kind)
                fraction = self.group.exploration_fraction(kind, per_iteration, t.horizon)
                if fraction is not None:
                    t.config.exploration_fraction = fraction

    def train(self, steps: int, callback: GroupCallback | None = None, checkpoint_dir: str | os.PathLike | None = None,
              checkpoint_every: int | None = None) -> dict[str, float]:
        """Train every unfrozen kind until ``global_step >= steps``; metrics of the last iteration.

        Metric names are the engine's prefixed by the kind (``predator/losses/policy``) plus the group's
        ``charts/sps`` and ``charts/agent_steps_per_s``. ``callback(metrics, global_step)`` returning False stops.
        """
        check_train_args(steps, checkpoint_dir, checkpoint_every)
        self._set_horizons(steps)
        return train_loop(self, self._iterate, steps, callback, checkpoint_dir, checkpoint_every)

    def _iterate(self) -> dict[str, float]:
        start = time.perf_counter()
        # 1. One joint rollout with every kind's current policy (noise seeded by (seed, iteration)).
        policies = {kind: NumpyPolicy(t.rollout_spec(), t.policy.numpy_weights()) for kind, t in self.trainers.items()}
        rng = np.random.default_rng([self.seed, self.iteration])
        rollouts, terminated_fraction = collect(self.joint, policies, self.n_steps, rng)
        self.global_step += self.num_envs * self.n_steps
        # 2. Each unfrozen kind runs exactly its engine update on its slice (and counts the iteration).
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

    def evaluate(self, episodes: int = 10, seed: int = 10_000) -> dict[str, KindEvalResult]:
        """Deterministic actions for every kind, one episode on each of ``episodes`` env copies."""
        if not isinstance(episodes, int) or episodes < 1:
            raise ValueError(f"evaluate episodes must be an int >= 1, got {episodes!r}")
        joint = self._joint(episodes, seed)
        try:
            results = run_episodes(joint, self.policies())
        finally:
            for env in joint.envs:
                env.close()
        out = {}
        for kind, rows in results.items():
            returns = [r for r, _, _ in rows]
            out[kind] = KindEvalResult(float(np.mean(returns)), float(np.std(returns)), returns,
                                       float(np.mean([n for _, n, _ in rows])), float(np.mean([t for *_, t in rows])))
        return out

    # -- persistence -------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """One atomic file: every kind's engine checkpoint, the env copies' state and the group's counters."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".group-") as tmp:
            kinds = {kind: load_checkpoint(t.save(Path(tmp) / f"{kind}.pt")) for kind, t in self.trainers.items()}
        try:
            joint = pickle.dumps(self.joint)
        except Exception as exc:
            raise ValueError(f"cannot checkpoint the group: its env copies are not picklable ({exc})") from exc
        state = {"format": 1, "group": _try_pickle(self.group), "env": _try_pickle(self.env),
                 "env_kwargs": self.env_kwargs, "num_envs": self.num_envs, "n_steps": self.n_steps, "seed": self.seed,
                 "global_step": self.global_step, "iteration": self.iteration, "horizon": self.horizon,
                 "agent_steps": self.agent_steps, "frozen": sorted(self.frozen), "joint": joint, "kinds": kinds}
        return atomic_save(state, path)

    @classmethod
    def load(cls, path: str | os.PathLike, env: Any = None, group: AgentGroup | None = None,
             device: str = "auto") -> "GroupTrainer":
        """Rebuild from ``save``; pass ``env``/``group`` when they could not be pickled (lambdas, local classes)."""
        state = load_checkpoint(path)
        for name, given in (("group", group), ("env", env)):
            if given is None and state[name] is None:
                raise ValueError(f"{path}: the {name} could not be pickled at save time; pass {name}= to load()")
        group = group or pickle.loads(state["group"])
        env = env if env is not None else pickle.loads(state["env"])
        trainer = cls(group, env, num_envs=state["num_envs"], n_steps=state["n_steps"], seed=state["seed"],
                      device=device, **state["env_kwargs"])
        trainer.joint = pickle.loads(state["joint"])
        with tempfile.TemporaryDirectory(prefix="opentinker-group-") as tmp:
            for kind, kind_state in state["kinds"].items():
                file = atomic_save(kind_state, Path(tmp) / f"{kind}.pt")
                trainer.trainers[kind] = ENGINE[group.policy_mapping[kind]].load(file, env=trainer.kind_spaces(kind),
                                                                                 device=device)
        trainer.global_step, trainer.iteration, trainer.horizon = state["global_step"], state["iteration"], state["horizon"]
        trainer.agent_steps, trainer.frozen = state["agent_steps"], set(state["frozen"])
        return trainer

    def export(self, directory: str | os.PathLike, metadata: dict | None = None) -> dict[str, Path]:
        """One engine export per kind under ``directory/<kind>`` (serve any kind's policy on its own)."""
        out = {}
        for kind, t in self.trainers.items():
            meta = {**(metadata or {}), "kind": kind, "agents": self.joint.agents[kind],
                    "shared_memory": self.group.shared_memory or "off", "policy_mapping": self.group.policy_mapping}
            out[kind] = export_policy(t, Path(directory) / kind, metadata=meta)
        return out

    def close(self) -> None:
        for env in self.joint.envs:
            env.close()


def _try_pickle(obj: Any) -> bytes | None:
    try:
        return pickle.dumps(obj)
    except Exception:  # a lambda or local class: ``load`` then needs it passed in
        return None
