"""Serving configuration: ``OPENTINKER_SERVE_*`` environment variables (set by ``deploy()`` and ``opentinker serve``).

Kept apart from ``infra.settings.Settings`` because these are per-server-process knobs handed to a
``bentoml serve`` child, not project-wide service locations (which the service still reads from
``get_settings()``: MLflow tracking URI, data dir).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL = "models:/opentinker-policy@champion"


class ServeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OPENTINKER_SERVE_", extra="ignore")

    model: str = Field(
        DEFAULT_MODEL,
        description="Policy to serve: models:/NAME@ALIAS, models:/NAME/VERSION, runs:/... or an export dir.",
    )
    api_key_hash: str = Field(
        "", description="scrypt hash of the API key (serving.auth.hash_api_key); never the key itself."
    )
    api_key_hash_file: Path | None = Field(None, description="File holding that hash, used when api_key_hash is empty.")
    reload_interval_s: float = Field(
        10.0, ge=0, description="How often to re-resolve the model URI (alias moves); 0 disables polling."
    )
    timeout_s: float = Field(10.0, gt=0, description="Per-request timeout; slower requests get 504.")
    max_concurrency: int = Field(
        64, gt=0, description="Requests in flight per worker; beyond it the server answers 429."
    )
    max_body_bytes: int = Field(1 << 20, gt=0, description="Largest accepted request body; larger gets 413.")
    max_batch_size: int = Field(
        1024, gt=1, description="Most observations per act_batch request, and per merged adaptive batch."
    )
    max_latency_ms: int = Field(
        1000, gt=0, description="Adaptive batching latency budget; requests expected to exceed it are shed with 503."
    )
    workers: int = Field(1, gt=0, description="Server worker processes (each loads the policy and polls the alias).")
    access_log: bool = Field(
        True, description="BentoML's per-request access log (costs throughput; keys are never in it)."
    )
    metrics: bool = Field(
        True, description="Prometheus metrics at /metrics (behind the API key like every non-health path)."
    )
    tracing: bool = Field(
        False,
        description=(
            "OpenTelemetry spans per request (BentoML turns them on; with no exporter configured they only cost CPU: "
            "~half of a small request)."
        ),
    )


def get_serve_settings() -> ServeSettings:
    """Read fresh each call: a server process reads it once at start; tests change the environment."""
    return ServeSettings()
