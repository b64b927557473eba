"""Flow parameters as pydantic models: Prefect records them on every flow run; config files are validated against
them. A training run's spec is ``tasks.spec.RunSpec`` (``TrainParams`` is its earlier name); ``load_spec`` reads
one from a config file and CLI flags."""

from __future__ import annotations

import difflib
import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from opentinker.tasks.spec import MEMBERS, TABLES, RunSpec

TrainParams = RunSpec
"""The earlier name of ``RunSpec`` (scripts and tests written against it keep working)."""


class ConfigError(ValueError):
    """A bad parameter or config file; the message names the field and what was expected."""


class EvalParams(BaseModel):
    """Evaluate a registered (or exported) model on fixed seeds."""

    model_config = ConfigDict(extra="forbid")

    model_uri: str = Field(description="models:/NAME@alias, models:/NAME/VERSION, runs:/... or an export dir.")
    episodes: int = Field(10, gt=0)
    seed: int = Field(10_000, ge=0)


def load_spec(config_file: Path | None = None, **overrides: Any) -> RunSpec:
    """Read a TOML/JSON config (optional) and apply overrides (CLI flags; None: not given); the one-line error names
    the field. A config with ``policy_mapping`` describes an agent group (``engine.algorithm == "group"``)."""
    data: dict[str, Any] = {}
    if config_file is not None:
        data = _read_config(config_file)
    data.update({key: value for key, value in overrides.items() if value is not None})
    try:
        return RunSpec(**data)
    except ValidationError as exc:
        source = f" in {config_file}" if config_file else ""
        algorithm = data.get("algorithm") or ("group" if "policy_mapping" in data else "ppo")
        kind = {"group": "multi-agent training", "grpo": "GRPO"}.get(algorithm, "training")
        details = describe_errors(exc, algorithm)
        if "\n" not in details:  # one problem: one line
            raise ConfigError(f"invalid {kind} config{source}: {details.strip().removeprefix('- ')}") from None
        raise ConfigError(f"invalid {kind} config{source}:\n" + details) from None


load_train_params = load_spec
"""The earlier name of ``load_spec``."""


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
        raise ConfigError(f"config file {path} must hold a table of RunSpec fields")
    return data


def describe_errors(exc: ValidationError, algorithm: str | None = None) -> str:
    """Pydantic's errors as '  - field: what was expected (got value)' lines; an unknown top-level field of a run spec
    says where it belongs (``algorithm``'s engine table) or the field it resembles."""
    lines = []
    for error in exc.errors():
        message = "unknown field" if error["type"] == "extra_forbidden" else error["msg"].removeprefix("Value error, ")
        loc = error["loc"][1:] if error["loc"][:1] == ("engine",) else error["loc"]  # as the config file writes it
        loc = loc[1:] if loc[:1] == ("group",) else loc  # a group's fields sit at the top level
        if error["type"] == "union_tag_invalid":
            tags = ", ".join(map(repr, MEMBERS))
            lines.append(f"  - algorithm: expected one of {tags} (got {error['ctx']['tag']!r})")
            continue
        if not loc:  # a whole-model check: its message already names the field
            lines.append(f"  - {message}")
            continue
        field = ".".join(str(part) for part in loc)
        shown = error["type"] != "missing" and not isinstance(error.get("input", {}), dict)  # not a whole table
        got = f" (got {error['input']!r})" if shown else ""
        unknown = error["type"] == "extra_forbidden" and len(loc) == 1 and algorithm is not None
        hint = _placement_hint(field, algorithm) if unknown else ""
        lines.append(f"  - {field}: {message}{got}{hint}")
    return "\n".join(lines)


def _placement_hint(name: str, algorithm: str) -> str:
    """Where an unknown top-level field of a run spec belongs: its algorithm's table, or a field of like spelling."""
    engine = MEMBERS[algorithm].model_fields if algorithm in TABLES else {}
    settings = {field: f"{algorithm}.{field}" for field in engine if field != "algorithm"}
    if name in settings:
        return f"; it is a {algorithm} setting: {settings[name]} (the [{algorithm}] table of a config file)"
    known = {field: field for field in [*RunSpec.model_fields, "algorithm", *MEMBERS]} | settings
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
    return f"; did you mean {known[close[0]]!r}?" if close else ""


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
    eval_action: str = "greedy"
    """What the model serves and the gate judged (``eval_mean``): ``greedy`` or ``sampled`` actions."""
    eval_greedy_mean: float | None = None
    eval_sampled_mean: float | None = None
    """Both actions' means where the policy is stochastic (None: not evaluated)."""
    threshold: float | None = None
    """The gate's threshold (None: the env has none; the gate compared with the champion or a random policy)."""
    passed_threshold: bool
    global_step: int
    start_step: int
    train_seconds: float
    checkpoint_path: str
    artifact_uris: list[str]
