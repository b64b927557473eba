"""The server's own records, tenants, API keys, jobs and uploads, in one SQL database (SQLAlchemy).

SQLite under the data dir by default, PostgreSQL (or any SQLAlchemy URL) through ``server_database_url``: whatever
survives a server restart lives here, so every API process of one deployment shares it. Times are Unix seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from opentinker.tasks.spec import RunSpec

from .schemas import JobResult, Progress


class Typed(sa.TypeDecorator):
    """A pydantic model stored as JSON and read back as the model: the record is typed where it is written, and every
    reader gets the model, never a dict to index."""

    impl = sa.JSON
    cache_ok = True
    should_evaluate_none = True  # None is JSON null: a column made NOT NULL by an older server still takes it

    def __init__(self, model: type):
        super().__init__()
        self.model = model

    def process_bind_param(self, value, dialect):
        return None if value is None else value.model_dump(mode="json")

    def process_result_value(self, value, dialect):
        return self.model.model_validate(value) if value else None  # {}: a row from before it was typed


class Base(DeclarativeBase):
    type_annotation_map: ClassVar = {dict[str, Any]: sa.JSON, list[str]: sa.JSON}


class Tenant(Base):
    """A tenant and its quotas (None: no limit; for the job_* limits, the server's default)."""

    __tablename__ = "tenants"
    name: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    created_at: Mapped[float] = mapped_column(default=time.time)
    max_running_jobs: Mapped[int | None] = mapped_column(default=None)
    max_queued_jobs: Mapped[int | None] = mapped_column(default=None)
    max_steps_per_job: Mapped[int | None] = mapped_column(sa.BigInteger, default=None)
    max_gpus: Mapped[float | None] = mapped_column(default=None)
    # Per-job limits (None: the server's setting of the same name; infra/cgroups.py's limits_for combines them).
    job_memory_mb: Mapped[int | None] = mapped_column(sa.BigInteger, default=None)
    job_max_processes: Mapped[int | None] = mapped_column(default=None)
    job_cpus: Mapped[float | None] = mapped_column(default=None)


class ApiKey(Base):
    """One key: its public id, the tenant it acts for, its scopes, and only a salted hash of the secret."""

    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    tenant: Mapped[str] = mapped_column(sa.ForeignKey("tenants.name"), index=True)
    key_hash: Mapped[str] = mapped_column(sa.String(200))
    scopes: Mapped[list[str]]
    label: Mapped[str] = mapped_column(sa.String(200), default="")
    created_at: Mapped[float] = mapped_column(default=time.time)
    revoked_at: Mapped[float | None] = mapped_column(default=None)


class Upload(Base):
    """A tenant's env code (a package archive), unpacked under the tenant's data dir."""

    __tablename__ = "uploads"
    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    tenant: Mapped[str] = mapped_column(sa.ForeignKey("tenants.name"), index=True)
    sha256: Mapped[str] = mapped_column(sa.String(64))
    size: Mapped[int] = mapped_column(sa.BigInteger)
    filename: Mapped[str] = mapped_column(sa.String(255))
    packages: Mapped[list[str]] = mapped_column(default=list)
    created_at: Mapped[float] = mapped_column(default=time.time)


class Job(Base):
    """A training job: its run spec, where it is in its life, and what it produced."""

    __tablename__ = "jobs"
    __table_args__ = (sa.UniqueConstraint("tenant", "idempotency_key"),)
    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    tenant: Mapped[str] = mapped_column(sa.ForeignKey("tenants.name"), index=True)
    state: Mapped[str] = mapped_column(sa.String(16), index=True)
    spec: Mapped[RunSpec] = mapped_column(Typed(RunSpec))
    priority: Mapped[int] = mapped_column(default=0)
    idempotency_key: Mapped[str | None] = mapped_column(sa.String(200), default=None)
    upload_id: Mapped[str | None] = mapped_column(sa.ForeignKey("uploads.id"), default=None)
    flow_run_id: Mapped[str | None] = mapped_column(sa.String(40), default=None, index=True)
    created_at: Mapped[float] = mapped_column(default=time.time)
    queued_at: Mapped[float] = mapped_column(default=time.time)
    started_at: Mapped[float | None] = mapped_column(default=None)
    ended_at: Mapped[float | None] = mapped_column(default=None)
    reason: Mapped[str] = mapped_column(sa.Text, default="")
    phase: Mapped[str] = mapped_column(sa.String(16), default="")
    progress: Mapped[Progress | None] = mapped_column(Typed(Progress), default=lambda: None)  # a bound JSON null
    result: Mapped[JobResult | None] = mapped_column(Typed(JobResult), default=None)
    attempts: Mapped[int] = mapped_column(default=1)
    cancel_requested: Mapped[bool] = mapped_column(default=False)
    token_hash: Mapped[str] = mapped_column(sa.String(200), default="")
    launch_host: Mapped[str] = mapped_column(sa.String(255), default="")
    updated_at: Mapped[float] = mapped_column(default=time.time, onupdate=time.time)


class Service(Base):
    """A policy service the server started for a tenant's registered model version."""

    __tablename__ = "services"
    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    tenant: Mapped[str] = mapped_column(sa.ForeignKey("tenants.name"), index=True)
    job_id: Mapped[str | None] = mapped_column(sa.String(40), default=None)
    model_name: Mapped[str] = mapped_column(sa.String(255))
    model_version: Mapped[str] = mapped_column(sa.String(32))
    url: Mapped[str] = mapped_column(sa.String(255))
    process: Mapped[dict[str, Any]] = mapped_column(default=dict)
    proxy_key: Mapped[str] = mapped_column(sa.String(200))
    created_at: Mapped[float] = mapped_column(default=time.time)
    stopped_at: Mapped[float | None] = mapped_column(default=None)


class Store:
    """The database behind one server: an engine, its tables, and short transactions (``with store.session()``)."""

    def __init__(self, url: str):
        self.url = url
        options: dict[str, Any] = {"pool_pre_ping": True}
        if url.startswith("sqlite"):
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
            # As many connections as the API has threads (anyio's 40): a burst of polls reuses them instead of
            # opening (and setting up) overflow connections that are closed again.
            options = {"connect_args": {"check_same_thread": False, "timeout": 30}, "pool_size": 40}
        self.engine = sa.create_engine(url, **options)
        if url.startswith("sqlite"):
            sa.event.listen(self.engine, "connect", _sqlite_pragmas)
        Base.metadata.create_all(self.engine)
        _add_new_columns(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """One transaction: committed when the block ends, rolled back when it raises."""
        with self._sessions.begin() as session:
            yield session

    def close(self) -> None:
        self.engine.dispose()


def _add_new_columns(engine: sa.Engine) -> None:
    """Columns added to a table since its database was made (all nullable, with model defaults): ``create_all``
    makes missing tables only, so a server upgraded in place would fail on every query of that table."""
    inspector = sa.inspect(engine)
    for table in Base.metadata.sorted_tables:
        present = {column["name"] for column in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name not in present and column.nullable:
                kind = column.type.compile(dialect=engine.dialect)
                with engine.begin() as connection:
                    connection.execute(sa.text(f'ALTER TABLE {table.name} ADD COLUMN "{column.name}" {kind}'))


def _sqlite_pragmas(connection, _record) -> None:
    """WAL lets readers (status polls) run beside the writer; a busy writer is waited for, not failed."""
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()
