"""Request and response models of the server's API, shared by the app and its client (pydantic only: importing this
module pulls in neither FastAPI nor Prefect)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .tenants import Quotas


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    version: str
    jobs: bool = Field(description="Whether this server runs jobs (a Prefect work pool is attached).")


class Whoami(BaseModel):
    tenant: str
    key_id: str
    scopes: list[str]


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str = Field(description="The tenant the key acts for (created with default quotas if new).")
    scopes: list[str] = Field(
        default_factory=lambda: ["jobs", "read", "models", "tinker"],
        description="What the key may do: admin, jobs, read, models, tinker.",
    )
    label: str = Field("", max_length=200, description="A note for listings (who or what uses the key).")


class KeyOut(BaseModel):
    id: str = Field(description="The key's public id (the part after 'tml-', before '_').")
    tenant: str
    scopes: list[str]
    label: str
    created_at: datetime
    revoked_at: datetime | None = None


class KeyCreated(KeyOut):
    key: str = Field(description="The key itself: shown this once, stored only as a salted hash.")


class TenantOut(Quotas):
    name: str
    created_at: datetime


class QuotasUpdate(BaseModel):
    """Fields to change; a field sent as null removes that limit, a field left out keeps its value."""

    model_config = ConfigDict(extra="forbid")

    max_running_jobs: int | None = Field(None, ge=1)
    max_queued_jobs: int | None = Field(None, ge=0)
    max_steps_per_job: int | None = Field(None, ge=1)
    max_gpus: float | None = Field(None, ge=0)


class ErrorBody(BaseModel):
    detail: Any = Field(description="One line naming the field or the limit, and what was expected.")
