"""The Tinker API's records in the server's database (``opentinker.server.db``): sessions, training runs,
checkpoints and requests, so what a client made stays readable after its session ends or the server restarts, and
every API process on one database sees the same.

What lives here is history and metadata; the live objects (adapters, optimiser state, futures' results, sequence
order) are still the engine's own (``sessions.Registry``): a request's row says which engine holds its future, so
one that a stopped engine took along fails naming what to do, instead of being unknown. A training run is readable
while it is live or while it has a checkpoint that has not expired; ``prune`` forgets the rest.
"""

from __future__ import annotations

import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from opentinker.server.db import Base, Store


class TinkerSession(Base):
    """One SDK ``ServiceClient``: ``active`` until it finishes (``finished``) or its heartbeats stop (``expired``)."""

    __tablename__ = "tinker_sessions"
    session_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(sa.String(64), index=True)
    status: Mapped[str] = mapped_column(sa.String(16), default="active")
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON, default=None)
    display_name: Mapped[str | None] = mapped_column(sa.String(255), default=None)
    created_at: Mapped[float] = mapped_column(default=time.time)
    ended_at: Mapped[float | None] = mapped_column(default=None)


class TinkerTrainingRun(Base):
    """A training client (``<session>:train:<n>``): its base model, adapter shape and the user's metadata."""

    __tablename__ = "tinker_training_runs"
    model_id: Mapped[str] = mapped_column(sa.String(200), primary_key=True)
    tenant: Mapped[str] = mapped_column(sa.String(64), index=True)
    session_id: Mapped[str] = mapped_column(sa.String(64), index=True)
    base_model: Mapped[str] = mapped_column(sa.String(255))
    lora_rank: Mapped[int]
    shape: Mapped[dict[str, Any]]
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON, default=None)
    created_at: Mapped[float] = mapped_column(default=time.time)
    last_request_at: Mapped[float] = mapped_column(default=time.time)
    ended_at: Mapped[float | None] = mapped_column(default=None)


class TinkerCheckpoint(Base):
    """A ``tinker://`` checkpoint: its files are a folder on the tenant's store (``store.CheckpointStore``)."""

    __tablename__ = "tinker_checkpoints"
    __table_args__ = (sa.UniqueConstraint("tenant", "tinker_path"),)
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(sa.String(64), index=True)
    model_id: Mapped[str] = mapped_column(sa.String(200), index=True)
    kind: Mapped[str] = mapped_column(sa.String(32))
    """The path segment: ``weights`` or ``sampler_weights``."""
    name: Mapped[str] = mapped_column(sa.String(128))
    tinker_path: Mapped[str] = mapped_column(sa.String(400))
    base_model: Mapped[str] = mapped_column(sa.String(255))
    size_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    created_at: Mapped[float] = mapped_column(default=time.time)
    expires_at: Mapped[float | None] = mapped_column(default=None, index=True)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON, default=None)


class TinkerRequest(Base):
    """A request (a future's id): what it was for and which engine (``Core.engine_id``) holds its future."""

    __tablename__ = "tinker_requests"
    request_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(sa.String(64))
    kind: Mapped[str] = mapped_column(sa.String(64))
    owner: Mapped[str] = mapped_column(sa.String(200))
    """The model or sampler it was for."""
    engine: Mapped[str] = mapped_column(sa.String(32))
    created_at: Mapped[float] = mapped_column(default=time.time, index=True)


TABLES = [
    TinkerSession.__table__,
    TinkerTrainingRun.__table__,
    TinkerCheckpoint.__table__,
    TinkerRequest.__table__,
]


def ensure_tables(db: Store) -> None:
    """Create the Tinker tables if the database predates them (``Store`` creates those imported before it)."""
    Base.metadata.create_all(db.engine, tables=TABLES)


def live_checkpoint(now: float | None = None) -> sa.ColumnElement[bool]:
    """The checkpoints that have not expired."""
    now = time.time() if now is None else now
    return sa.or_(TinkerCheckpoint.expires_at.is_(None), TinkerCheckpoint.expires_at > now)


class Records:
    """Reads and writes of the sessions and training runs (blocking: off the event loop where it can wait)."""

    def __init__(self, db: Store):
        self.db = db
        ensure_tables(db)

    # -- sessions --------------------------------------------------------------------------------------------------
    def add_session(self, session_id: str, tenant: str, user_metadata: dict | None, display_name: str | None) -> None:
        with self.db.session() as session:
            session.add(
                TinkerSession(
                    session_id=session_id, tenant=tenant, user_metadata=user_metadata, display_name=display_name
                )
            )

    def end_session(self, session_id: str, status: str) -> None:
        """The session and its training runs ended (``finished`` or ``expired``)."""
        now = time.time()
        with self.db.session() as session:
            session.execute(
                sa.update(TinkerSession)
                .filter_by(session_id=session_id, status="active")
                .values(status=status, ended_at=now)
            )
            session.execute(
                sa.update(TinkerTrainingRun)
                .filter_by(session_id=session_id, ended_at=None)
                .values(ended_at=now, last_request_at=now)
            )

    def session(self, tenant: str, session_id: str) -> TinkerSession | None:
        with self.db.session() as session:
            return session.scalars(sa.select(TinkerSession).filter_by(tenant=tenant, session_id=session_id)).first()

    def session_ids(self, tenant: str, limit: int, offset: int) -> list[str]:
        query = sa.select(TinkerSession.session_id).filter_by(tenant=tenant).order_by(TinkerSession.created_at)
        with self.db.session() as session:
            return list(session.scalars(query.offset(offset).limit(limit)))

    def run_ids(self, session_id: str) -> list[str]:
        query = sa.select(TinkerTrainingRun.model_id).filter_by(session_id=session_id)
        with self.db.session() as session:
            return list(session.scalars(query.order_by(TinkerTrainingRun.created_at)))

    # -- training runs ---------------------------------------------------------------------------------------------
    def add_run(self, run: TinkerTrainingRun) -> None:
        with self.db.session() as session:
            session.merge(run)

    def end_run(self, model_id: str) -> None:
        now = time.time()
        with self.db.session() as session:
            session.execute(
                sa.update(TinkerTrainingRun).filter_by(model_id=model_id, ended_at=None).values(ended_at=now)
            )

    def run(self, tenant: str, model_id: str) -> TinkerTrainingRun | None:
        with self.db.session() as session:
            return session.scalars(sa.select(TinkerTrainingRun).filter_by(tenant=tenant, model_id=model_id)).first()

    def readable_runs(self, tenant: str, live: set[str], model_id: str | None = None) -> list[TinkerTrainingRun]:
        """The tenant's training runs that are live (``live``: the ids this process serves) or have a live
        checkpoint, oldest first."""
        has_checkpoint = (
            sa.select(TinkerCheckpoint.id)
            .where(TinkerCheckpoint.tenant == tenant, TinkerCheckpoint.model_id == TinkerTrainingRun.model_id)
            .where(live_checkpoint())
            .exists()
        )
        query = sa.select(TinkerTrainingRun).filter_by(tenant=tenant)
        query = query.where(sa.or_(TinkerTrainingRun.model_id.in_(live), has_checkpoint))
        if model_id is not None:
            query = query.filter_by(model_id=model_id)
        with self.db.session() as session:
            return list(session.scalars(query.order_by(TinkerTrainingRun.created_at)))

    # -- requests --------------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, tenant: str, kind: str, owner: str, engine: str) -> None:
        with self.db.session() as session:
            session.add(TinkerRequest(request_id=request_id, tenant=tenant, kind=kind, owner=owner, engine=engine))

    def request(self, tenant: str, request_id: str) -> TinkerRequest | None:
        with self.db.session() as session:
            return session.scalars(sa.select(TinkerRequest).filter_by(tenant=tenant, request_id=request_id)).first()

    def prune(self, keep_s: float) -> None:
        """Forget ended training runs without a live checkpoint, sessions ended ``keep_s`` ago whose runs are all
        forgotten, and requests made ``keep_s`` ago."""
        horizon = time.time() - keep_s
        has_checkpoint = (
            sa.select(TinkerCheckpoint.id)
            .where(TinkerCheckpoint.tenant == TinkerTrainingRun.tenant)
            .where(TinkerCheckpoint.model_id == TinkerTrainingRun.model_id)
            .where(live_checkpoint())
            .exists()
        )
        has_run = sa.select(TinkerTrainingRun.model_id).filter_by(session_id=TinkerSession.session_id).exists()
        with self.db.session() as session:
            session.execute(
                sa.delete(TinkerTrainingRun)
                .where(TinkerTrainingRun.ended_at.is_not(None), ~has_checkpoint)
                .execution_options(synchronize_session=False)
            )
            session.execute(
                sa.delete(TinkerSession)
                .where(TinkerSession.ended_at < horizon, ~has_run)
                .execution_options(synchronize_session=False)
            )
            session.execute(sa.delete(TinkerRequest).where(TinkerRequest.created_at < horizon))
