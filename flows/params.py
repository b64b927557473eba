"""Flow parameters as pydantic models: Prefect records them on every flow run; config files are validated against
them."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import json
import textwrap
import tomllib
import typing
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from opentinker.agents.config import CONFIGS, ENV_FIELDS, check_fields
from opentinker.tracking.registry import slug


class ConfigError(ValueError):
    """A bad parameter or config file; the message names the field and what was expected."""


class EngineParams(BaseModel):
    """One algorithm's engine config as a pydantic model: its fields are the config class's (defined once, in
    ``agents/config.py``), each None until set (None: the preset's value, else the engine's default)."""

    model_config = ConfigDict(extra="forbid")
    config_cls: ClassVar[type]

    @model_validator(mode="before")
    @classmethod
    def _fields_apply(cls, data: Any) -> Any:
        """Another algorithm's field is named as such, not as an unknown one."""
        if isinstance(data, dict):
            check_fields(cls.model_fields["algorithm"].default, (key for key in data if key != "algorithm"))
        return data

    @model_validator(mode="after")
    def _valid_values(self) -> EngineParams:
        self.config_cls(**self.overrides())  # its __post_init__ names the field and the expected range
        return self

    def overrides(self) -> dict[str, Any]:
        """The fields that are set, as the trainer's keyword arguments."""
        return self.model_dump(exclude={"algorithm"}, exclude_none=True)


def engine_params(algorithm: str) -> type[EngineParams]:
    """The ``TrainParams.engine`` union member of an algorithm, built from its config class in ``CONFIGS``."""
    config_cls = CONFIGS[algorithm]
    hints, docs = typing.get_type_hints(config_cls), _field_docs(config_cls)
    fields: dict[str, Any] = {
        field.name: (hints[field.name] | None, Field(None, description=docs.get(field.name)))
        for field in dataclasses.fields(config_cls)
    }
    model = create_model(
        config_cls.__name__.replace("Config", "Params"),
        __base__=EngineParams,
        __doc__=f"``{config_cls.__name__}`` fields for ``algorithm = {algorithm!r}``.",
        algorithm=(Literal[algorithm], algorithm),
        **fields,
    )
    model.config_cls = config_cls
    return model


def _field_docs(config_cls: type) -> dict[str, str]:
    """The docstring under each field of a config dataclass (CleanRL style), for Prefect's parameter form."""
    docs: dict[str, str] = {}
    for cls in reversed(config_cls.__mro__[:-1]):
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        for node, doc in itertools.pairwise(body):
            if isinstance(node, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
                docs[node.target.id] = inspect.cleandoc(doc.value.value)
    return docs


Engine = Annotated[Union[tuple(engine_params(name) for name in CONFIGS)], Field(discriminator="algorithm")]  # noqa: UP007
"""The engine config, one union member per algorithm of ``agents.config.CONFIGS`` (tagged by ``algorithm``)."""


class TrainParams(BaseModel):
    """Everything one training flow run needs; recorded by Prefect and logged to MLflow as params.

    ``engine`` is the typed engine config of the chosen algorithm (``PPOParams``/``DQNParams``, the fields of
    ``PPOConfig``/``DQNConfig``). A config file writes it in its own form (``config_form``): ``algorithm`` and the
    env-copy fields (``num_envs``, ``workers``, ``backend``, ``state_diff``) at the top level, the algorithm's
    other fields in the table of its name (``[ppo]``/``[dqn]``); an ``[engine]`` table is read as well. Fields left
    out come from the preset for the env's kind of problem (``flows/presets.py``); a field or a table of another
    algorithm is an error naming the field and the algorithm, never ignored.
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
    engine: Engine = Field(
        default_factory=lambda: engine_params("ppo")(),
        description="The algorithm ('ppo' or 'dqn') and its engine config fields, over the preset.",
    )
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

    @model_validator(mode="before")
    @classmethod
    def _from_config_form(cls, data: Any) -> Any:
        """The config file's form (see the class docstring) into ``engine``; keys given at the top level (CLI flags
        are) win over the same keys in an ``[engine]`` table."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        engine = data.pop("engine", None) or {}
        if isinstance(engine, BaseModel):
            engine = engine.model_dump(exclude_none=True)
        engine = {**engine, **{key: data.pop(key) for key in ("algorithm", *ENV_FIELDS) if key in data}}
        algorithm = engine.setdefault("algorithm", "ppo")
        for name in CONFIGS:
            table = data.pop(name, None)
            if not table:
                continue
            if name != algorithm:
                raise ValueError(
                    f"{name}: does not apply to algorithm {algorithm!r} (set algorithm = "
                    f"{name!r} to train with it, or move the fields to the [{algorithm}] table)"
                )
            if not isinstance(table, dict):
                raise ValueError(f"{name}: expected a table of {CONFIGS[name].__name__} fields, got {table!r}")
            misplaced = sorted(set(table) & set(ENV_FIELDS))
            if misplaced:
                raise ValueError(f"{name}.{misplaced[0]}: set it at the top level, not in the [{name}] table")
            engine.update(table)
        data["engine"] = engine
        return data

    @model_validator(mode="after")
    def _local_has_no_workers(self) -> TrainParams:
        if self.engine.backend == "local" and self.engine.workers is not None and self.engine.workers > 1:
            raise ValueError("workers: Ray rollout actors need backend 'ray' or 'auto', not 'local'")
        return self

    def config_form(self) -> dict[str, Any]:
        """The params as a config file writes them, unset (None) fields left out: what MLflow logs as params."""
        engine = self.engine.model_dump(exclude_none=True)
        algorithm = engine.pop("algorithm")
        top = {key: engine.pop(key) for key in ENV_FIELDS if key in engine}
        return {**self.model_dump(exclude={"engine"}), "algorithm": algorithm, **top, algorithm: engine}

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
        loc = error["loc"][1:] if error["loc"][:1] == ("engine",) else error["loc"]  # as the config file writes it
        if error["type"] == "union_tag_invalid":
            tags = ", ".join(map(repr, CONFIGS))
            lines.append(f"  - algorithm: expected one of {tags} (got {error['ctx']['tag']!r})")
            continue
        if not loc:  # a whole-model check: its message already names the field
            lines.append(f"  - {message}")
            continue
        field = ".".join(str(part) for part in loc)
        shown = error["type"] != "missing" and not isinstance(error.get("input", {}), dict)  # not a whole table
        got = f" (got {error['input']!r})" if shown else ""
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
