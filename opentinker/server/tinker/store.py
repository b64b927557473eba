"""Checkpoints as ``tinker://`` paths on the tenant's store, with time-to-live.

    tinker://<model_id>/weights/<name>           training state: adapter, optimiser, step (``save_state``)
    tinker://<model_id>/sampler_weights/<name>   a peft adapter folder (sampling clients, the model registry)

A checkpoint is a folder ``<tenant data dir>/tinker/checkpoints/<model_id>/<kind>/<name>/`` holding its files,
written to a temporary folder and renamed, so a crash never leaves half a checkpoint, and a row of the server's
database (``records.TinkerCheckpoint``: type, time, expiry, size, base model, user metadata), written once the folder
is in place: the row is what makes it exist (listing and usage are queries, never a walk of the folders). A path
resolves only inside the caller's tenant (another tenant's is not found); an expired checkpoint is not found either,
and ``sweep`` deletes it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from opentinker.server.db import Store

from .records import TinkerCheckpoint, ensure_tables, live_checkpoint

log = logging.getLogger(__name__)

KINDS = {"weights": "training", "sampler_weights": "sampler"}
"""Path segment -> Tinker's ``checkpoint_type``."""
LEGACY_META = "checkpoint.json"
"""Where servers before the database kept a checkpoint's metadata: adopted once (``adopt``), never written."""
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9:._-]{0,199}$")


class CheckpointError(ValueError):
    """A checkpoint path or name that cannot be used (the message says why)."""


class CheckpointNotFound(CheckpointError):
    pass


@dataclass(frozen=True)
class CheckpointPath:
    model_id: str
    kind: str
    """``weights`` or ``sampler_weights``."""
    name: str

    @property
    def uri(self) -> str:
        return f"tinker://{self.model_id}/{self.kind}/{self.name}"

    @classmethod
    def parse(cls, uri: str) -> CheckpointPath:
        parts = uri.removeprefix("tinker://").split("/") if uri.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] not in KINDS:
            raise CheckpointError(
                f"path: expected tinker://<model_id>/weights/<name> or tinker://<model_id>/sampler_weights/<name>, "
                f"got {uri!r}"
            )
        return cls.make(*parts)

    @classmethod
    def make(cls, model_id: str, kind: str, name: str) -> CheckpointPath:
        if not _MODEL_ID.match(model_id):
            raise CheckpointNotFound(f"path: no model {model_id!r}")
        if not _NAME.match(name or ""):
            raise CheckpointError(
                f"name: expected 1-128 characters of letters, digits, '.', '_' and '-', starting with a letter or "
                f"digit, got {name!r}"
            )
        return cls(model_id, kind, name)


class CheckpointStore:
    """Checkpoints of every tenant: files under ``root(tenant)``, records in ``db``."""

    def __init__(self, root: Callable[[str], Path], db: Store):
        self.root, self.db = root, db
        ensure_tables(db)

    def folder(self, tenant: str, path: CheckpointPath) -> Path:
        return self.root(tenant) / "tinker" / "checkpoints" / path.model_id / path.kind / path.name

    def write(
        self,
        tenant: str,
        path: CheckpointPath,
        fill: Callable[[Path], None],
        base_model: str,
        ttl_seconds: int | None = None,
        overwrite: bool = False,
        user_metadata: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Write a checkpoint with ``fill(folder)``; its metadata. Existing (and live) and not ``overwrite``: an
        error."""
        _check_ttl(ttl_seconds)
        if not overwrite and self._row(tenant, path.uri) is not None:
            raise CheckpointError(f"{path.uri} already exists (save with overwrite=True to replace it)")
        target = self.folder(tenant, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            staging.mkdir()
            fill(staging)
            size = sum(f.stat().st_size for f in staging.rglob("*") if f.is_file())
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        now = time.time()
        with self.db.session() as session:
            session.execute(sa.delete(TinkerCheckpoint).filter_by(tenant=tenant, tinker_path=path.uri))
            row = TinkerCheckpoint(
                tenant=tenant,
                model_id=path.model_id,
                kind=path.kind,
                name=path.name,
                tinker_path=path.uri,
                base_model=base_model,
                size_bytes=size,
                created_at=now,
                expires_at=now + ttl_seconds if ttl_seconds else None,
                user_metadata=user_metadata,
            )
            session.add(row)
        return _meta(row)

    def open(self, tenant: str, uri: str) -> tuple[CheckpointPath, Path, dict[str, Any]]:
        """(path, folder, metadata) of a live checkpoint of ``tenant``; not found otherwise."""
        path = CheckpointPath.parse(uri)
        row = self._row(tenant, path.uri)
        if row is None:
            raise CheckpointNotFound(f"{uri}: no such checkpoint (or it expired)")
        return path, self.folder(tenant, path), _meta(row)

    def list(self, tenant: str, model_id: str | None = None) -> list[dict[str, Any]]:
        """The tenant's live checkpoints (of ``model_id``), oldest first."""
        query = sa.select(TinkerCheckpoint).filter_by(tenant=tenant).where(live_checkpoint())
        if model_id is not None:
            query = query.filter_by(model_id=model_id)
        with self.db.session() as session:
            rows = session.scalars(query.order_by(TinkerCheckpoint.created_at, TinkerCheckpoint.id)).all()
        return [_meta(row) for row in rows]

    def search(
        self,
        tenant: str,
        user_metadata: dict[str, str],
        checkpoint_type: str | None,
        base_models: list[str] | None,
        limit: int,
        after: int | None,
    ) -> tuple[list[dict[str, Any]], int | None]:
        """The tenant's live checkpoints matching every filter, newest recorded first: (one page of at most
        ``limit``, the record id to pass as ``after`` for the next page, or None on the last)."""
        query = sa.select(TinkerCheckpoint).filter_by(tenant=tenant).where(live_checkpoint())
        if checkpoint_type is not None:
            kinds = [kind for kind, name in KINDS.items() if name == checkpoint_type]
            query = query.where(TinkerCheckpoint.kind.in_(kinds))
        if base_models is not None:
            query = query.where(TinkerCheckpoint.base_model.in_(base_models))
        if after is not None:
            query = query.where(TinkerCheckpoint.id < after)
        page: list[TinkerCheckpoint] = []
        with self.db.session() as session:
            for row in session.scalars(query.order_by(TinkerCheckpoint.id.desc())):
                metadata = row.user_metadata or {}
                if all(metadata.get(key) == value for key, value in user_metadata.items()):
                    page.append(row)
                    if len(page) > limit:
                        break
        more = len(page) > limit
        page = page[:limit]
        return [_meta(row) for row in page], (page[-1].id if more else None)

    def usage_bytes(self, tenant: str) -> int:
        query = sa.select(sa.func.coalesce(sa.func.sum(TinkerCheckpoint.size_bytes), 0)).filter_by(tenant=tenant)
        with self.db.session() as session:
            return int(session.scalar(query.where(live_checkpoint())))

    def delete(self, tenant: str, uri: str) -> None:
        path, folder, _ = self.open(tenant, uri)
        with self.db.session() as session:
            session.execute(sa.delete(TinkerCheckpoint).filter_by(tenant=tenant, tinker_path=path.uri))
        shutil.rmtree(folder, ignore_errors=True)

    def set_ttl(self, tenant: str, uri: str, ttl_seconds: int | None) -> dict[str, Any]:
        """Expire the checkpoint ``ttl_seconds`` from now (None: never)."""
        _check_ttl(ttl_seconds)
        path = CheckpointPath.parse(uri)
        with self.db.session() as session:
            row = session.scalars(
                sa.select(TinkerCheckpoint).filter_by(tenant=tenant, tinker_path=path.uri).where(live_checkpoint())
            ).first()
            if row is None:
                raise CheckpointNotFound(f"{uri}: no such checkpoint (or it expired)")
            row.expires_at = time.time() + ttl_seconds if ttl_seconds else None
        return _meta(row)

    def sweep(self) -> int:
        """Delete every tenant's expired checkpoints (records, then folders); how many went."""
        with self.db.session() as session:
            expired = session.scalars(
                sa.select(TinkerCheckpoint).where(TinkerCheckpoint.expires_at <= time.time())
            ).all()
            for row in expired:
                session.delete(row)
        for row in expired:
            path = CheckpointPath(row.model_id, row.kind, row.name)
            shutil.rmtree(self.folder(row.tenant, path), ignore_errors=True)
        return len(expired)

    def adopt(self, tenants_root: Path) -> int:
        """Record the checkpoints a server before the database left with a ``checkpoint.json`` (once, at start:
        the file is removed once its row exists); how many."""
        adopted = 0
        for meta_file in sorted(tenants_root.glob(f"*/tinker/checkpoints/*/*/*/{LEGACY_META}")):
            try:
                meta = json.loads(meta_file.read_text())
                path = CheckpointPath.parse(meta["tinker_path"])
                tenant = meta_file.parents[5].name
                expires = meta.get("expires_at")
                row = TinkerCheckpoint(
                    tenant=tenant,
                    model_id=path.model_id,
                    kind=path.kind,
                    name=path.name,
                    tinker_path=path.uri,
                    base_model=str(meta["base_model"]),
                    size_bytes=int(meta["size_bytes"]),
                    created_at=datetime.fromisoformat(meta["time"]).timestamp(),
                    expires_at=datetime.fromisoformat(expires).timestamp() if expires else None,
                    user_metadata=meta.get("user_metadata"),
                )
            except (OSError, ValueError, KeyError, IndexError) as error:
                log.warning("not adopting %s: %s", meta_file, error)
                continue
            if self._row(tenant, path.uri, live_only=False) is None:
                with self.db.session() as session:
                    session.add(row)
                adopted += 1
            meta_file.unlink(missing_ok=True)
        return adopted

    def _row(self, tenant: str, uri: str, live_only: bool = True) -> TinkerCheckpoint | None:
        query = sa.select(TinkerCheckpoint).filter_by(tenant=tenant, tinker_path=uri)
        if live_only:
            query = query.where(live_checkpoint())
        with self.db.session() as session:
            return session.scalars(query).first()


def _check_ttl(ttl_seconds: int | None) -> None:
    if ttl_seconds is not None and ttl_seconds < 1:
        raise CheckpointError(f"ttl_seconds: expected a positive number of seconds or None, got {ttl_seconds}")


def _iso(seconds: float | None) -> str | None:
    return datetime.fromtimestamp(seconds, UTC).isoformat() if seconds is not None else None


def _meta(row: TinkerCheckpoint) -> dict[str, Any]:
    """A checkpoint's record as Tinker's ``Checkpoint`` fields (plus ``base_model``)."""
    return {
        "checkpoint_id": f"{row.kind}/{row.name}",
        "checkpoint_type": KINDS[row.kind],
        "tinker_path": row.tinker_path,
        "time": _iso(row.created_at),
        "expires_at": _iso(row.expires_at),
        "size_bytes": row.size_bytes,
        "user_metadata": row.user_metadata,
        "base_model": row.base_model,
        "training_run_id": row.model_id,
        "record_id": row.id,
    }
