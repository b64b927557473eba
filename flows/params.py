"""Flow parameters as pydantic models: Prefect records them on every flow run; config files are validated against them."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from opentinker.tracking.registry import slug


class ConfigError(ValueError):
    """A bad parameter or config file; the message names the field and what was expected."""


ALGORITHMS = ("ppo", "dqn")
"""Keys of the engine's ``agents.config.CONFIGS``; each has a ``TrainParams`` table of the same name."""


class TrainParams(BaseModel):
    """Everything one training flow run needs; recorded by Prefect and logged to MLflow as params.

    ``algorithm`` selects the engine trainer; its hyper-parameters are the table of the same name (``ppo`` or
    ``dqn``), checked against the engine's ``PPOConfig``/``DQNConfig`` (each field defined once, there). Fields left
    out come from the preset for the env's kind of problem (``flows/presets.py``); a table of another algorithm is
    an error, never ignored.
    """

    model_config = ConfigDict(extra="forbid")

    env_id: str = Field(
        "CartPole-v1",
        min_length=1,
        description="Gymnasium id, or 'package.module:Class' / "
        "'package.module:factory' for your own env (importable where the rollouts run).",
    )
    steps: int = Field(200_000, gt=0, description="Total global env steps to reach (a resumed run continues up to it).")
    seed: int = Field(0, ge=0, description="Seeds the policy, the learner and every rollout (seed, iteration, worker).")
    algorithm: Literal[ALGORITHMS] = Field(
        "ppo", description="Training algorithm; its table holds its hyper-parameters."
    )
    num_envs: int | None = Field(None, gt=0, description="Env copies stepped in parallel; None: the preset's.")
    backend: Literal["auto", "local", "ray"] = Field(
        "auto",
        description="Where env copies run: 'local' (in-process, gymnasium's vectorised implementation when the "
        "env has one), 'ray' (rollout actors), 'auto' (Ray when workers is set or the env's step is costly, else "
        "local).",
    )
    workers: int | None = Field(None, gt=0, description="Ray rollout actors; None lets the engine choose.")
    num_gpus: float = Field(
        0.0,
        ge=0,
        description="GPUs the learner takes from Ray (fractions share one); it trains on "
        "the GPU Ray assigns. 0: device 'auto'.",
    )
    rollout_num_cpus: float | None = Field(
        None,
        ge=0,
        description="CPUs per rollout actor (fractions allowed); None: one, or an equal share of the free CPUs.",
    )
    rollout_num_gpus: float = Field(0.0, ge=0, description="GPUs per rollout actor (fractions allowed).")
    ppo: dict[str, Any] = Field(
        default_factory=dict, description="PPOConfig fields (algorithm 'ppo'), over the preset."
    )
    dqn: dict[str, Any] = Field(
        default_factory=dict, description="DQNConfig fields (algorithm 'dqn'), over the preset."
    )
    checkpoint_every: int | None = Field(
        None, gt=0, description="Env steps between checkpoints; None checkpoints at the end only."
    )
    resume: bool = Field(False, description="Continue from the run's last checkpoint instead of starting over.")
    run_name: str | None = Field(
        None, description="Names the checkpoint dir (resume key); default '<env_id>-seed<seed>'."
    )
    model_name: str | None = Field(None, description="Registered model name; default 'opentinker-<env_id>'.")
    eval_episodes: int = Field(10, gt=0, description="Deterministic evaluation episodes.")
    eval_seed: int = Field(10_000, ge=0, description="Seed of the first evaluation episode (then +1 per episode).")
    champion_threshold: float | None = Field(
        None,
        description="Evaluation mean a candidate needs before it may become champion. None: the env spec's "
        "reward_threshold, or when it has none, beating the champion (the first model: a random policy by a clear "
        "margin).",
    )
    experiment: str | None = Field(None, description="MLflow experiment; default from settings.")

    @field_validator(*ALGORITHMS)
    @classmethod
    def _known_config_fields(cls, table: dict[str, Any], info) -> dict[str, Any]:
        """Checked against the engine's config class here, so a typo fails before any service starts."""
        if table:
            import dataclasses

            from opentinker.agents.config import CONFIGS, ENV_FIELDS

            config_cls = CONFIGS[info.field_name]
            known = {field.name for field in dataclasses.fields(config_cls)} - set(ENV_FIELDS)
            unknown = sorted(set(table) - known)
            if unknown:
                where = (
                    "set it at the top level, not in the table"
                    if unknown[0] in ENV_FIELDS
                    else f"expected one of: {', '.join(sorted(known))}"
                )
                raise ValueError(f"unknown {config_cls.__name__} field {unknown[0]!r} ({where})")
            config_cls(**table)  # its __post_init__ names the field and the expected range
        return table

    @model_validator(mode="after")
    def _one_algorithm(self) -> TrainParams:
        for other in ALGORITHMS:
            if other != self.algorithm and getattr(self, other):
                raise ValueError(
                    f"{other}: does not apply to algorithm {self.algorithm!r} (set algorithm = "
                    f"{other!r} to train with it, or move the fields to the [{self.algorithm}] table)"
                )
        if self.backend == "local" and self.workers is not None and self.workers > 1:
            raise ValueError("workers: Ray rollout actors need backend 'ray' or 'auto', not 'local'")
        return self

    @property
    def engine_overrides(self) -> dict[str, Any]:
        """The selected algorithm's table."""
        return getattr(self, self.algorithm)

    @property
    def resolved_run_name(self) -> str:
        return self.run_name or f"{slug(self.env_id)}-seed{self.seed}"

    @property
    def resolved_model_name(self) -> str:
        return self.model_name or f"opentinker-{slug(self.env_id)}"


class EvalParams(BaseModel):
    """Evaluate a registered (or exported) model on fixed seeds."""

    model_config = ConfigDict(extra="forbid")

    model_uri: str = Field(description="models:/NAME@alias, models:/NAME/VERSION, runs:/... or an export dir.")
    episodes: int = Field(10, gt=0)
    seed: int = Field(10_000, ge=0)


class MultiAgentParams(BaseModel):
    """A multi-agent training run (see docs/multiagent.md for the group's semantics); a config file holding
    ``policy_mapping`` makes ``opentinker train`` run this instead of ``TrainParams``."""

    model_config = ConfigDict(extra="forbid")

    env_id: str = Field("pursuit", description="Env id: 'pursuit' (the built-in predator–prey env).")
    env_kwargs: dict[str, Any] = Field(default_factory=dict, description="Passed to the env factory.")
    policy_mapping: dict[str, str] = Field(default_factory=lambda: {"predator": "PPO", "prey": "DQN"})
    configs: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Per-kind hyper-parameters (configure)."
    )
    shared_memory: bool | str = False
    steps: int = Field(4096, ge=1, description="Env steps over all env copies.")
    seed: int = 0
    num_envs: int = Field(4, ge=1)
    n_steps: int = Field(32, ge=1)
    backend: str = Field(
        "auto", description='Where env copies run: "local", "ray" (Ray actors) or "auto" (as RemoteEnv).'
    )
    workers: int | None = Field(None, ge=1, description="Ray actors for the env copies (None: one per cluster CPU).")
    eval_episodes: int = Field(5, ge=1)
    eval_seed: int = 10_000
    run_name: str = "multiagent"
    model_name: str = Field("pursuit", description="Each kind registers as '<model_name>-<kind>'.")
    experiment: str | None = None
    resume: bool = False
    checkpoint_every: int | None = None

    @model_validator(mode="after")
    def _valid_group(self) -> MultiAgentParams:
        """The group's own checks (kinds, algorithms, per-kind fields) run here, before any service starts."""
        from opentinker.agents.multiagent import AgentGroup

        AgentGroup(self.policy_mapping, shared_memory=self.shared_memory).configure(**self.configs)
        return self


def load_train_params(config_file: Path | None = None, **overrides: Any) -> TrainParams | MultiAgentParams:
    """Read a TOML/JSON config (optional) and apply CLI overrides; errors name the offending field.

    A config with ``policy_mapping`` describes an agent group and gives ``MultiAgentParams``.
    """
    data: dict[str, Any] = {}
    if config_file is not None:
        data = _read_config(config_file)
    data.update({key: value for key, value in overrides.items() if value is not None})
    model = MultiAgentParams if "policy_mapping" in data else TrainParams
    try:
        return model(**data)
    except ValidationError as exc:
        source = f" in {config_file}" if config_file else ""
        kind = "multi-agent training" if model is MultiAgentParams else "training"
        details = describe_errors(exc)
        if "\n" not in details:  # one problem: one line
            raise ConfigError(f"invalid {kind} config{source}: {details.strip().removeprefix('- ')}") from None
        raise ConfigError(f"invalid {kind} config{source}:\n" + details) from None


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(
            f"config file {path} is not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {exc}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table of TrainParams fields")
    return data


def describe_errors(exc: ValidationError) -> str:
    """Pydantic's errors as '  - field: what was expected (got value)' lines."""
    lines = []
    for error in exc.errors():
        message = "unknown field" if error["type"] == "extra_forbidden" else error["msg"].removeprefix("Value error, ")
        if not error["loc"]:  # a whole-model check: its message already names the field
            lines.append(f"  - {message}")
            continue
        field = ".".join(str(part) for part in error["loc"])
        got = f" (got {error['input']!r})" if error["type"] != "missing" and "input" in error else ""
        lines.append(f"  - {field}: {message}{got}")
    return "\n".join(lines)


class TrainFlowResult(BaseModel):
    """What a training flow run produced: ids and numbers to print or pass on."""

    run_id: str
    run_url: str
    experiment_id: str
    model_name: str
    model_version: str
    aliases: list[str]
    decision: str
    eval_mean: float
    eval_std: float
    threshold: float | None = None
    """The gate's threshold (None: the env has none; the gate compared with the champion or a random policy)."""
    passed_threshold: bool
    global_step: int
    start_step: int
    train_seconds: float
    checkpoint_path: str
    artifact_uris: list[str]
