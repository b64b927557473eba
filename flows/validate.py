"""Checks that run before any heavy work, so bad input fails in a second with a message naming the field."""

from __future__ import annotations

from opentinker.flows.params import ConfigError


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


def check_presets(params) -> None:
    """The preset for (algorithm, env) exists: e.g. DQN refuses continuous actions here, before any service starts."""
    from opentinker.flows.presets import resolve_params

    try:
        resolve_params(params)
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
