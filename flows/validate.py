"""Checks that run before any heavy work, so bad input fails in a second with a message naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opentinker.agents.config import CONFIGS
from opentinker.flows.params import ConfigError, load_spec
from opentinker.tasks.spec import RunSpec


def check_env_id(env_id: str) -> None:
    """``env_id`` must name a registered environment or an importable ``module:Class``/``module:factory`` that
    passes ``validate_env``."""
    from opentinker.envs import validate_env
    from opentinker.envs.errors import EnvSpecError, EnvValidationError

    try:
        validate_env(env_id)
    except EnvValidationError as exc:
        raise ConfigError(f"env_id: {env_id!r} failed validate_env: {'; '.join(exc.problems)}") from None
    except EnvSpecError as exc:
        raise ConfigError(f"env_id: {exc}") from None


def check_text_env(env_id: str) -> None:
    """A text env given as ``module:factory`` builds a ``TextEnv`` for both splits (shipped names are checked by the
    spec itself)."""
    from opentinker.envs.text_tasks import SPLITS, make_text_env

    try:
        for split in SPLITS:
            make_text_env(env_id, split)
    except ValueError as exc:
        raise ConfigError(f"env_id: {exc}") from None


def resolved(spec: RunSpec) -> RunSpec:
    """``resolve_spec``, its refusals as one line: e.g. DQN refuses continuous actions here, before any service
    starts."""
    from opentinker.flows.presets import resolve_spec

    try:
        return resolve_spec(spec)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_cron(cron: str) -> None:
    """Validated by Prefect's own schedule model, so what passes here is what the server accepts."""
    from prefect.client.schemas.schedules import CronSchedule
    from pydantic import ValidationError

    try:
        CronSchedule(cron=cron)
    except ValidationError:
        raise ConfigError(f"cron: {cron!r} is not a valid cron expression (expected e.g. '0 3 * * *')") from None


def check_prefect_server() -> None:
    """A schedule needs a Prefect server that outlives this command (the ephemeral one does not)."""
    import os

    if not os.environ.get("PREFECT_API_URL"):
        raise ConfigError(
            "prefect_api_url: a schedule needs a Prefect server; run `opentinker stack up` "
            "or set OPENTINKER_PREFECT_API_URL (e.g. http://127.0.0.1:4200/api)"
        )


def checked_spec(env_id: str | None, config: Path | None, groups: bool = False, **overrides: Any) -> RunSpec:
    """The run's spec from a config file + overrides, checked and resolved before any work: the env
    (``validate_env``; a text env builds), the algorithm's config, and the preset for the env's kind of problem.
    The spec comes back resolved, so the run does not resolve it again.

    ``groups``: whether the caller can run a multi-agent config (one with ``policy_mapping``).
    """
    spec = load_spec(config, env_id=env_id, **overrides)
    if spec.algorithm in CONFIGS:
        check_env_id(spec.env_id)
    elif spec.algorithm == "grpo" and ":" in spec.env_id:
        check_text_env(spec.env_id)
    elif spec.algorithm == "group" and not groups:  # group envs are PettingZoo envs, checked when the group is built
        raise ConfigError(
            "policy_mapping: this command deploys the single-agent train_flow; "
            "train an agent group with `opentinker train ENV --config FILE`"
        )
    return resolved(spec)


def check_deployment(cron: str | None) -> None:
    """A deployment's cron (if any) is valid and a Prefect server is there to hold it."""
    if cron is not None:
        check_cron(cron)
    check_prefect_server()
