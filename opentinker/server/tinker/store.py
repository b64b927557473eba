"""Checkpoints as ``tinker://`` paths on the tenant's store, with time-to-live.

    tinker://<model_id>/weights/<name>           training state: adapter, optimiser, step (``save_state``)
    tinker://<model_id>/sampler_weights/<name>   a peft adapter folder (sampling clients, the model registry)

A checkpoint is a folder ``<tenant data dir>/tinker/checkpoints/<model_id>/<kind>/<name>/`` holding its files and
``checkpoint.json`` (type, time, expiry, size, user metadata), written to a temporary folder and renamed, so a crash
never leaves half a checkpoint. A path resolves only inside the caller's tenant (another tenant's is not found); an
expired checkpoint is not found either, and ``sweep`` deletes it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

KINDS = {"weights": "training", "sampler_weights": "sampler"}
"""Path segment -> Tinker's ``checkpoint_type``."""
META = "checkpoint.json"
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
    """Checkpoints of every tenant under ``root(tenant)``."""

    def __init__(self, root: Callable[[str], Path]):
        self.root = root

    def folder(self, tenant: str, path: CheckpointPath) -> Path:
        return self.root(tenant) / "tinker" / "checkpoints" / path.model_id / path.kind / path.name

    def write(
        self,
        tenant: str,
        path: CheckpointPath,
        fill: Callable[[Path], None],
        ttl_seconds: int | None = None,
        overwrite: bool = False,
        user_metadata: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Write a checkpoint with ``fill(folder)``; its metadata (``extra`` added to it). Existing and not
        ``overwrite``: an error."""
        if ttl_seconds is not None and ttl_seconds < 1:
            raise CheckpointError(f"ttl_seconds: expected a positive number of seconds or None, got {ttl_seconds}")
        target = self.folder(tenant, path)
        if target.exists() and not overwrite and self._live(target):
            raise CheckpointError(f"{path.uri} already exists (save with overwrite=True to replace it)")
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            staging.mkdir()
            fill(staging)
            now = datetime.now(UTC)
            meta = {
                "checkpoint_id": f"{path.kind}/{path.name}",
                "checkpoint_type": KINDS[path.kind],
                "tinker_path": path.uri,
                "time": now.isoformat(),
                "expires_at": (now + timedelta(seconds=ttl_seconds)).isoformat() if ttl_seconds else None,
                "size_bytes": sum(f.stat().st_size for f in staging.rglob("*") if f.is_file()),
                "user_metadata": user_metadata,
                **(extra or {}),
            }
            (staging / META).write_text(json.dumps(meta, indent=2))
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return meta

    def open(self, tenant: str, uri: str) -> tuple[CheckpointPath, Path, dict[str, Any]]:
        """(path, folder, metadata) of a live checkpoint of ``tenant``; not found otherwise."""
        path = CheckpointPath.parse(uri)
        folder = self.folder(tenant, path)
        meta = self._live(folder)
        if meta is None:
            raise CheckpointNotFound(f"{uri}: no such checkpoint (or it expired)")
        return path, folder, meta

    def list(self, tenant: str, model_id: str | None = None) -> list[dict[str, Any]]:
        base = self.root(tenant) / "tinker" / "checkpoints"
        pattern = f"{model_id}/*/*/{META}" if model_id else f"*/*/*/{META}"
        found = [self._live(meta.parent) for meta in sorted(base.glob(pattern))] if base.is_dir() else []
        return [meta for meta in found if meta is not None]

    def usage_bytes(self, tenant: str) -> int:
        return sum(int(meta["size_bytes"]) for meta in self.list(tenant))

    def delete(self, tenant: str, uri: str) -> None:
        shutil.rmtree(self.open(tenant, uri)[1])

    def set_ttl(self, tenant: str, uri: str, ttl_seconds: int | None) -> dict[str, Any]:
        """Expire the checkpoint ``ttl_seconds`` from now (None: never)."""
        if ttl_seconds is not None and ttl_seconds < 1:
            raise CheckpointError(f"ttl_seconds: expected a positive number of seconds or None, got {ttl_seconds}")
        _, folder, meta = self.open(tenant, uri)
        expires = datetime.now(UTC) + timedelta(seconds=ttl_seconds) if ttl_seconds else None
        meta["expires_at"] = expires.isoformat() if expires else None
        staging = folder / f".{META}.{uuid.uuid4().hex}.tmp"
        staging.write_text(json.dumps(meta, indent=2))
        os.replace(staging, folder / META)
        return meta

    def sweep(self, tenants_root: Path) -> int:
        """Delete every tenant's expired checkpoints; how many went."""
        removed = 0
        for meta_file in tenants_root.glob(f"*/tinker/checkpoints/*/*/*/{META}"):
            if self._live(meta_file.parent) is None:
                shutil.rmtree(meta_file.parent, ignore_errors=True)
                removed += 1
        return removed

    @staticmethod
    def _live(folder: Path) -> dict[str, Any] | None:
        try:
            meta = json.loads((folder / META).read_text())
        except (OSError, ValueError):
            return None
        expires = meta.get("expires_at")
        if expires and datetime.fromisoformat(expires) <= datetime.now(UTC):
            return None
        return meta
