"""Where each tenant's things live, and its quotas: every job and Tinker session writes only to these places.

A tenant name is a short lowercase slug, so it can name a directory, a Prefect work queue, an MLflow experiment and
an S3 prefix as it is. With the embedded stack (no MLflow server configured) each tenant also has its own MLflow
store under its data dir, so a job's sandbox can hold its tenant's store and nothing else.
"""

from __future__ import annotations

import re
from pathlib import Path

from opentinker.infra.settings import Settings, get_settings

from .db import Tenant
from .schemas import Quotas

NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
MODEL_SEPARATOR = "."


class TenantError(ValueError):
    """A tenant name that cannot be used (the message says what is expected)."""


def base_model_cache(settings: Settings) -> Path:
    """The server's one cache of converted base models (``tinker_cache_dir``, else ``<data_dir>/llm-cache``): the
    Tinker API loads from it and GRPO jobs read it, read-only, so no tenant converts (and stores) its own copy."""
    return Path(settings.tinker_cache_dir or settings.resolved_data_dir / "llm-cache")


def check_name(tenant: str) -> str:
    if not isinstance(tenant, str) or not NAME_PATTERN.match(tenant):
        raise TenantError(
            f"tenant: expected 1-63 characters of a-z, 0-9 and '-', starting with a letter or digit (got {tenant!r})"
        )
    return tenant


def data_dir(tenant: str, settings: Settings | None = None) -> Path:
    """The tenant's files: its MLflow store (embedded stack), uploads and job run directories."""
    return (settings or get_settings()).resolved_data_dir / "tenants" / check_name(tenant)


def uploads_dir(tenant: str, settings: Settings | None = None) -> Path:
    return data_dir(tenant, settings) / "uploads"


def experiment(tenant: str) -> str:
    """The MLflow experiment every run of the tenant's jobs goes to."""
    return f"tenant-{check_name(tenant)}"


def model_prefix(tenant: str) -> str:
    """Registered models of the tenant are named ``<tenant>.<name>``."""
    return f"{check_name(tenant)}{MODEL_SEPARATOR}"


def model_name(tenant: str, name: str) -> str:
    """``name`` inside the tenant's namespace (unchanged when it already is)."""
    prefix = model_prefix(tenant)
    return name if name.startswith(prefix) else f"{prefix}{name}"


def owns_model(tenant: str, name: str) -> bool:
    return name.startswith(model_prefix(tenant))


def s3_prefix(tenant: str) -> str:
    """The key prefix of the tenant's objects in the bucket."""
    return f"tenants/{check_name(tenant)}/"


def work_queue(tenant: str) -> str:
    """The tenant's Prefect work queue in the server's work pool (its concurrency limit is the running-jobs quota)."""
    return f"tenant-{check_name(tenant)}"


def tracking_uri(tenant: str, settings: Settings | None = None) -> str:
    """The MLflow store the tenant's jobs write to: the configured MLflow server, else the tenant's own SQLite."""
    settings = settings or get_settings()
    if settings.mlflow_tracking_uri:
        return settings.mlflow_tracking_uri
    return f"sqlite:///{data_dir(tenant, settings) / 'mlflow.db'}"


def ensure_tenant(session, tenant: str, quotas: Quotas | None = None) -> Tenant:
    """The tenant's row, made with ``quotas`` (the defaults when None) if it does not exist yet."""
    row = session.get(Tenant, check_name(tenant))
    if row is None:
        row = Tenant(name=tenant, **(quotas or Quotas()).model_dump())
        session.add(row)
        session.flush()
    return row


def set_quotas(session, tenant: str, **changes: int | float | None) -> Tenant:
    """Create the tenant if new, then set the named quotas (None removes a limit); checked like ``Quotas``."""
    row = ensure_tenant(session, tenant)
    current = {field: getattr(row, field) for field in Quotas.model_fields}
    for field, value in Quotas(**{**current, **changes}).model_dump().items():
        setattr(row, field, value)
    session.flush()
    return row
