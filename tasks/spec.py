"""``RunSpec``: the one typed spec of a training run, whatever its algorithm and wherever it starts (``opentinker
train``, the SDK, a Prefect deployment, a job submitted to the server).

It is resolved once (``flows.presets.resolve_spec`` fills the preset and marks it ``resolved``), then passed whole:
flow → tasks → training process. Across a process boundary it travels as one ``model_dump_json()`` and comes back
equal through ``model_validate_json()``; two specs are the same run when they are equal.

``engine`` is the algorithm's typed config, a union tagged by ``algorithm``: one member per entry of
``agents.config.CONFIGS`` (built from its config dataclass, so each field is declared once, with its docstring),
``grpo`` (a language model's LoRA adapter on a text env; its budget counts optimiser ``updates``) and ``group``
(agent kinds trained together). ``engine.config()`` is the typed object the trainer is built from.

A config file writes a spec in its own form (``RunSpec.config_form``): ``algorithm`` and the engine's run-shape
fields (``num_envs``, ``workers``, ``backend``, ...) at the top level, the algorithm's other fields in the table of
its name (``[ppo]``, ``[dqn]``, ``[grpo]``); an ``[engine]`` table is read as well; a file with ``policy_mapping``
is a group run. A field of another algorithm is an error that says so, never ignored.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
import typing
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from opentinker.agents.config import CONFIGS, ENV_FIELDS, GRPOConfig
from opentinker.tracking.registry import slug


class EngineSpec(BaseModel):
    """Base of the ``RunSpec.engine`` members: one algorithm's fields, each config field None until set (None: the
    preset's value, else the config's default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    config_cls: ClassVar[type]
    top_level: ClassVar[tuple[str, ...]] = ENV_FIELDS
    """Fields a config file writes at its top level (the run's shape), not in the algorithm's table."""

    @model_validator(mode="before")
    @classmethod
    def _fields_apply(cls, data: Any) -> Any:
        """Another algorithm's field is named as such, not as an unknown one."""
        if isinstance(data, dict):
            check_names(cls.model_fields["algorithm"].default, (key for key in data if key != "algorithm"))
        return data

    @model_validator(mode="after")
    def _valid_values(self) -> EngineSpec:
        self.config()  # the config's __post_init__ names the field and the expected range
        return self

    def config_fields(self) -> dict[str, Any]:
        """The config fields that are set."""
        names = {field.name for field in dataclasses.fields(self.config_cls)}
        return {key: value for key, value in self.model_dump(exclude_none=True).items() if key in names}

    def config(self, **fields: Any) -> Any:
        """The typed config the trainer is built from (``fields``: ones the spec holds elsewhere)."""
        return self.config_cls(**self.config_fields(), **fields)

    @classmethod
    def of(cls, config: Any, **fields: Any) -> EngineSpec:
        """The member holding every field of a built config (what an SDK trainer trains with)."""
        held = {key: value for key, value in dataclasses.asdict(config).items() if key in cls.model_fields}
        return cls(**{**held, **fields})


def member(algorithm: str, config_cls: type, base: type[EngineSpec] = EngineSpec, **extra: Any) -> type[EngineSpec]:
    """An engine member built from a config dataclass: its fields (docstrings kept for Prefect's parameter form)
    plus ``extra`` (pydantic field definitions of what the run needs beyond the config)."""
    hints, docs = typing.get_type_hints(config_cls), _field_docs(config_cls)
    fields: dict[str, Any] = {
        field.name: (hints[field.name] | None, Field(None, description=docs.get(field.name)))
        for field in dataclasses.fields(config_cls)
        if field.name not in extra and field.name != "task"
    }
    model = create_model(
        f"{algorithm.upper()}Spec",
        __base__=base,
        __doc__=f"``{config_cls.__name__}`` fields for ``algorithm = {algorithm!r}``.",
        algorithm=(Literal[algorithm], algorithm),
        **fields,
        **extra,
    )
    model.config_cls = config_cls
    return model


def _field_docs(config_cls: type) -> dict[str, str]:
    """The docstring under each field of a config dataclass (CleanRL style)."""
    docs: dict[str, str] = {}
    for cls in reversed(config_cls.__mro__[:-1]):
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        for node, doc in itertools.pairwise(body):
            if isinstance(node, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
                docs[node.target.id] = inspect.cleandoc(doc.value.value)
    return docs


class _GRPOBase(EngineSpec):
    top_level: ClassVar[tuple[str, ...]] = ("updates", "workers", "backend", "eval_every")

    def config(self, **fields: Any) -> GRPOConfig:
        """``GRPOConfig``; its ``task`` is the run's ``env_id`` (pass ``task=``)."""
        return super().config(**fields)


GRPOSpec = member(
    "grpo",
    GRPOConfig,
    _GRPOBase,
    updates=(int, Field(50, gt=0, description="Optimiser updates (each: prompts_per_step x group_size episodes).")),
    workers=(int, Field(2, gt=0, description="Rollout workers.")),
    backend=(Literal["ray", "local"], Field("ray", description="'ray' actors or in-process workers.")),
    eval_every=(int | None, Field(None, gt=0, description="Updates between held-out evaluations (a curve).")),
)
"""GRPO on a text env (``RunSpec.env_id``: a shipped task or ``module:factory``); its budget is ``updates``."""


class GroupSpec(EngineSpec):
    """Agent kinds trained together on one multi-agent env (docs/multiagent.md): ``AgentGroup``'s description."""

    top_level: ClassVar[tuple[str, ...]] = (
        "policy_mapping",
        "configs",
        "shared_memory",
        "env_kwargs",
        "num_envs",
        "n_steps",
        "backend",
        "workers",
    )

    algorithm: Literal["group"] = "group"
    policy_mapping: dict[str, str] = Field(
        default_factory=lambda: {"predator": "PPO", "prey": "DQN"}, description="Agent kind -> 'PPO' or 'DQN'."
    )
    configs: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Per-kind hyper-parameters (``AgentGroup.configure``)."
    )
    shared_memory: bool | str = Field(False, description="False, True/'all' or 'kind' (``AgentGroup``).")
    env_kwargs: dict[str, Any] = Field(default_factory=dict, description="Passed to the env factory.")
    num_envs: int = Field(4, ge=1, description="Env copies.")
    n_steps: int = Field(32, ge=1, description="Steps each env copy runs per iteration.")
    backend: str = Field("auto", description='Where env copies run: "local", "ray" or "auto" (as RemoteEnv).')
    workers: int | None = Field(None, ge=1, description="Ray actors for the env copies (None: one per cluster CPU).")

    def config(self) -> Any:
        """The configured ``AgentGroup`` (its own checks name the kind and the field)."""
        from opentinker.agents.multiagent.group import AgentGroup

        return AgentGroup(self.policy_mapping, shared_memory=self.shared_memory).configure(**self.configs)


MEMBERS: dict[str, type[EngineSpec]] = {
    **{name: member(name, config_cls) for name, config_cls in CONFIGS.items()},
    "grpo": GRPOSpec,
    "group": GroupSpec,
}
"""Algorithm -> its ``RunSpec.engine`` member."""
TABLES = (*CONFIGS, "grpo")
"""Algorithms whose config fields a config file writes in a table of their name."""
Engine = Annotated[Union[tuple(MEMBERS.values())], Field(discriminator="algorithm")]  # noqa: UP007
"""The engine config, one union member per algorithm (tagged by ``algorithm``)."""

DEFAULT_ENV = {"grpo": "arithmetic", "group": "pursuit"}
"""``env_id`` when none is given (others: CartPole-v1)."""
DEFAULT_STEPS = {"group": 4096}
"""``steps`` when none is given (others: 200,000; GRPO counts ``engine.updates`` instead)."""
ENV_STEP_ONLY = {
    "grpo": ("steps", "num_gpus", "rollout_num_cpus", "rollout_num_gpus", "eval_episodes", "eval_seed"),
    "group": ("num_gpus", "rollout_num_cpus", "rollout_num_gpus"),
}
"""Run fields an algorithm does not use: setting one is an error naming it."""


def check_names(algorithm: str, names: typing.Iterable[str]) -> None:
    """Every name is a field of ``algorithm``'s member; else the error says why: another algorithm's field does not
    apply to this one, anything else is unknown."""
    fields = lambda name: set(MEMBERS[name].model_fields) - {"algorithm"}  # noqa: E731
    known = fields(algorithm)
    for name in names:
        if name in known:
            continue
        owners = [other for other in TABLES if name in fields(other)]
        if owners:
            raise ValueError(
                f"{name!r} does not apply to algorithm {algorithm!r} (a {MEMBERS[owners[0]].config_cls.__name__} "
                f"field: set algorithm = {owners[0]!r} to use it)"
            )
        config = MEMBERS[algorithm].__name__ if algorithm == "group" else MEMBERS[algorithm].config_cls.__name__
        raise ValueError(f"unknown {config} field {name!r}; expected one of: {', '.join(sorted(known))}")


class RunSpec(BaseModel):
    """Everything one training run needs: Prefect records it on the flow run, MLflow logs it as params, the server
    stores it as the job record. See the module docstring for ``engine`` and the config file's form."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    env_id: str = Field(
        "CartPole-v1",
        min_length=1,
        description="Gymnasium id, or 'package.module:Class' / 'package.module:factory' for your own env "
        "(importable where the rollouts run); GRPO: a shipped text task or your TextEnv's 'module:factory'.",
    )
    steps: int | None = Field(
        None,
        gt=0,
        description="Total global env steps to reach (a resumed run continues up to it); default 200,000 "
        "(group: 4,096). GRPO counts engine.updates instead ('steps' is read as its old spelling).",
    )
    seed: int = Field(0, ge=0, description="Seeds the policy, the learner and every rollout (seed, iteration, worker).")
    engine: Engine = Field(
        default_factory=lambda: MEMBERS["ppo"](),
        description="The algorithm and its config fields, over the preset.",
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
        None, gt=0, description="Steps (GRPO: updates) between checkpoints; None checkpoints at the end only."
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
        "margin). GRPO: held-out success in [0, 1] (default 0).",
    )
    experiment: str | None = Field(None, description="MLflow experiment; default from settings.")
    resolved: bool = Field(
        False, description="Defaults made concrete (flows.presets.resolve_spec); a resolved spec is not resolved again."
    )

    @model_validator(mode="before")
    @classmethod
    def _from_config_form(cls, data: Any) -> Any:
        """The config file's form (see the module docstring) into ``engine``; keys given at the top level (CLI flags
        are) win over the same keys in an ``[engine]`` table."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        engine = data.pop("engine", None) or {}
        engine = engine.model_dump(exclude_none=True) if isinstance(engine, BaseModel) else dict(engine)
        algorithm = data.get("algorithm") or engine.get("algorithm")
        algorithm = algorithm or ("group" if "policy_mapping" in data or "policy_mapping" in engine else "ppo")
        top_level = MEMBERS[algorithm].top_level if algorithm in MEMBERS else ENV_FIELDS
        engine.update({key: data.pop(key) for key in ("algorithm", *top_level) if key in data})
        engine["algorithm"] = algorithm
        for name in TABLES:
            table = data.pop(name, None)
            if not table:
                continue
            if name != algorithm:
                raise ValueError(
                    f"{name}: does not apply to algorithm {algorithm!r} (set algorithm = "
                    f"{name!r} to train with it, or move the fields to the [{algorithm}] table)"
                )
            if not isinstance(table, dict):
                raise ValueError(
                    f"{name}: expected a table of {MEMBERS[name].config_cls.__name__} fields, got {table!r}"
                )
            misplaced = sorted(set(table) & set(top_level))
            if misplaced:
                raise ValueError(f"{name}.{misplaced[0]}: set it at the top level, not in the [{name}] table")
            engine.update(table)
        if algorithm == "grpo":
            _grpo_old_spellings(data, engine)
        elif "updates" in data:
            raise ValueError(
                f"updates: counts GRPO's optimiser updates; algorithm {algorithm!r} counts env steps (steps)"
            )
        data.setdefault("env_id", DEFAULT_ENV.get(algorithm, "CartPole-v1"))
        if algorithm != "grpo" and data.get("steps") is None:
            data["steps"] = DEFAULT_STEPS.get(algorithm, 200_000)
        data["engine"] = engine
        return data

    @model_validator(mode="after")
    def _fits_the_algorithm(self) -> RunSpec:
        algorithm = self.engine.algorithm
        for name in ENV_STEP_ONLY.get(algorithm, ()):
            if getattr(self, name) != type(self).model_fields[name].default:
                raise ValueError(f"{name}: does not apply to algorithm {algorithm!r}")
        if algorithm in CONFIGS and self.engine.backend == "local" and (self.engine.workers or 1) > 1:
            raise ValueError("workers: Ray rollout actors need backend 'ray' or 'auto', not 'local'")
        if algorithm == "grpo" and ":" not in self.env_id:
            from opentinker.envs.text_tasks import text_task

            try:
                text_task(self.env_id)
            except ValueError as exc:
                raise ValueError(f"env_id: {str(exc).removeprefix('task: ')}") from None
        return self

    def config_form(self) -> dict[str, Any]:
        """The spec as a config file writes it, unset (None) fields left out: what MLflow logs as params."""
        engine = self.engine.model_dump(exclude_none=True)
        algorithm = engine.pop("algorithm")
        top = {key: engine.pop(key) for key in type(self.engine).top_level if key in engine}
        table = {algorithm: engine} if engine else {}
        return {**self.model_dump(exclude={"engine"}, exclude_none=True), "algorithm": algorithm, **top, **table}

    @property
    def algorithm(self) -> str:
        return self.engine.algorithm

    @property
    def budget(self) -> int:
        """How far the run trains, in its algorithm's unit: env steps (GRPO: optimiser updates)."""
        return self.engine.updates if self.algorithm == "grpo" else self.steps

    @property
    def resolved_run_name(self) -> str:
        kind = "" if self.algorithm in CONFIGS else f"-{self.algorithm}"
        return self.run_name or f"{slug(self.env_id)}{kind}-seed{self.seed}"

    @property
    def resolved_model_name(self) -> str:
        """The registered model (a group registers ``<this>-<kind>`` per kind)."""
        if self.model_name:
            return self.model_name
        return {"grpo": f"opentinker-{slug(self.env_id)}-agent", "group": slug(self.env_id)}.get(
            self.algorithm, f"opentinker-{slug(self.env_id)}"
        )


def _grpo_old_spellings(data: dict[str, Any], engine: dict[str, Any]) -> None:
    """GRPO's earlier config form: ``task`` for the env, ``steps`` for its optimiser updates."""
    task = data.pop("task", None)
    if task is not None and "env_id" not in data:
        data["env_id"] = task
    steps = data.pop("steps", None)
    if steps is not None:
        if engine.setdefault("updates", steps) != steps:
            raise ValueError(
                f"steps: GRPO counts updates (steps is their old name); got steps={steps} and "
                f"updates={engine['updates']}, give one"
            )
