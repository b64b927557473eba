"""``AgentGroup``: which algorithm each agent kind trains with, and each kind's hyper-parameters.

The group is a validated description only (cheap, picklable); ``AgentGroup.build(env, ...)`` turns it into a
``GroupTrainer``. Every mistake is reported here, before any env or network exists, naming the kind and field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from opentinker.agents.config import DQNConfig, PPOConfig, TrainerConfig

ALGORITHMS: dict[str, type[TrainerConfig]] = {"PPO": PPOConfig, "DQN": DQNConfig}
# Short names users know from other libraries -> config fields.
ALIASES = {"lr": "learning_rate", "epsilon_start": "start_e", "epsilon_end": "end_e"}
# Set once for the whole group because every kind trains on the same rollouts.
GROUP_FIELDS = ("num_envs", "n_steps", "workers", "backend", "state_diff")
SHARED_MEMORY_MODES = (False, True, "all", "kind")


def _algorithm_name(kind: str, algorithm: Any) -> str:
    name = str(algorithm).upper() if isinstance(algorithm, str) else None
    if name not in ALGORITHMS:
        raise ValueError(
            f"policy_mapping[{kind!r}]: unknown algorithm {algorithm!r}; expected one of {sorted(ALGORITHMS)}"
        )
    return name


class AgentGroup:
    """``AgentGroup(policy_mapping={'predator': 'PPO', 'prey': 'DQN'}, shared_memory=False, agent_to_kind=None)``.

    Agents map to kinds by id prefix (``predator_3`` -> ``predator``; the longest matching kind wins) unless
    ``agent_to_kind(agent_id) -> kind`` is given. All agents of a kind share one network (parameter sharing).
    ``shared_memory``: False (default); True or "all" appends to every observation the previous step's mean
    observation of each kind in the same env copy; "kind" appends only the agent's own kind's mean.
    """

    def __init__(
        self,
        policy_mapping: dict[str, str],
        shared_memory: bool | str = False,
        agent_to_kind: Callable[[str], str] | None = None,
    ):
        if not isinstance(policy_mapping, dict) or not policy_mapping:
            raise ValueError(f"policy_mapping must be a non-empty dict kind -> algorithm, got {policy_mapping!r}")
        for kind in policy_mapping:
            if not isinstance(kind, str) or not kind:
                raise ValueError(f"policy_mapping keys must be non-empty strings (agent kinds), got {kind!r}")
        if shared_memory not in SHARED_MEMORY_MODES or shared_memory is None:
            raise ValueError(f"shared_memory must be one of {SHARED_MEMORY_MODES}, got {shared_memory!r}")
        if agent_to_kind is not None and not callable(agent_to_kind):
            raise ValueError(f"agent_to_kind must be a callable agent_id -> kind, got {agent_to_kind!r}")
        self.policy_mapping = {kind: _algorithm_name(kind, algo) for kind, algo in policy_mapping.items()}
        self.shared_memory = {True: "all", False: None}.get(shared_memory, shared_memory)
        self.agent_to_kind = agent_to_kind
        self.configs: dict[str, dict[str, Any]] = {kind: {} for kind in self.policy_mapping}

    @property
    def kinds(self) -> list[str]:
        return list(self.policy_mapping)

    def configure(self, **per_kind: dict[str, Any]) -> AgentGroup:
        """Per-kind hyper-parameters: ``configure(predator={'lr': 3e-4}, prey={'epsilon_decay': 0.995})``.

        Keys are PPOConfig/DQNConfig fields (``epsilon_decay`` is DQN's multiplicative per-step schedule) or the
        aliases ``lr``, ``epsilon_start``, ``epsilon_end``. Later calls update earlier ones.
        """
        for kind, params in per_kind.items():
            if kind not in self.policy_mapping:
                raise ValueError(f"configure: unknown kind {kind!r}; kinds in policy_mapping: {self.kinds}")
            if not isinstance(params, dict):
                raise ValueError(f"configure({kind}=...) expects a dict of hyper-parameters, got {params!r}")
            config_cls = ALGORITHMS[self.policy_mapping[kind]]
            fields = {f.name for f in dataclasses.fields(config_cls)}
            translated = {}
            for key, value in params.items():
                field = ALIASES.get(key, key)
                if field in GROUP_FIELDS:
                    raise ValueError(
                        f"configure({kind}=...): {key!r} is shared by the whole group (every kind trains "
                        "on the same rollouts); set num_envs=, n_steps=, backend=, workers= in AgentGroup.build"
                    )
                if field == "num_learners" and value != 1:
                    raise ValueError(
                        f"configure({kind}=...): num_learners must be 1 in an agent group (data-parallel learners "
                        f"run under Trainer.train; GroupTrainer updates each kind in its own process), got {value!r}"
                    )
                if field not in fields:
                    valid = sorted(fields - set(GROUP_FIELDS) | set(ALIASES))
                    raise ValueError(
                        f"configure({kind}=...): unknown {self.policy_mapping[kind]} hyper-parameter "
                        f"{key!r}; valid: {valid}"
                    )
                translated[field] = value
            merged = {**self.configs[kind], **translated}
            config_cls(**merged)  # validates values now, naming the field
            self.configs[kind] = merged
        return self

    def kind_of(self, agent: str) -> str:
        """The kind of ``agent``: ``agent_to_kind`` or the longest kind that prefixes its id."""
        if self.agent_to_kind is not None:
            kind = self.agent_to_kind(agent)
            if kind not in self.policy_mapping:
                raise ValueError(
                    f"agent_to_kind({agent!r}) returned {kind!r}, not a kind of policy_mapping {self.kinds}"
                )
            return kind
        matches = [k for k in self.policy_mapping if str(agent).startswith(k)]
        if not matches:
            raise ValueError(
                f"agent {agent!r} matches no kind of policy_mapping {self.kinds} by id prefix; "
                "rename the kinds or pass agent_to_kind="
            )
        return max(matches, key=len)

    def build(
        self,
        env: Any,
        num_envs: int = 1,
        n_steps: int = 64,
        seed: int = 0,
        device: str = "auto",
        backend: str = "auto",
        workers: int | None = None,
        **env_kwargs: Any,
    ):
        """A ``GroupTrainer`` on ``env``: "pursuit", a PettingZoo ParallelEnv class/factory, or an instance.

        ``backend``: "local", "ray" (env copies split over ``workers`` Ray actors) or "auto" (as ``RemoteEnv``).
        """
        from opentinker.agents.multiagent.trainer import GroupTrainer

        return GroupTrainer(
            self,
            env,
            num_envs=num_envs,
            n_steps=n_steps,
            seed=seed,
            device=device,
            backend=backend,
            workers=workers,
            **env_kwargs,
        )

    def __repr__(self) -> str:
        return f"AgentGroup(policy_mapping={self.policy_mapping}, shared_memory={self.shared_memory or False})"
