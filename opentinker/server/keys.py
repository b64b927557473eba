"""API keys: made once and shown once, kept only as salted scrypt hashes (``serving.auth``), checked per request.

A key reads ``tml-<id>_<secret>`` (the Tinker SDK refuses keys without the ``tml-`` prefix). The id is public: it
names the key in listings and finds its row, so a request costs one primary-key lookup (which also sees a
revocation at once) and, the first time a process meets the key, one scrypt check (~60 ms); after that the key is
remembered by a keyed digest (an HMAC under a per-process secret, never the key itself). Unknown and wrong keys are
remembered the same way in a bounded cache, and scrypt checks run one at a time, so a flood of bad keys costs at
most one core.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import sqlalchemy as sa

from opentinker.serving.auth import hash_api_key, verify_api_key

from .db import ApiKey, Store
from .tenants import check_name, ensure_tenant

PREFIX = "tml-"
SCOPES = {
    "admin": "tenants, quotas and keys of every tenant",
    "jobs": "submit, cancel and resume the tenant's jobs; upload env code",
    "read": "list jobs, status, logs, events, results and models of the tenant",
    "models": "evaluate and serve the tenant's registered models",
    "tinker": "the Tinker API (/api/v1) as the tenant",
    "worker": "fetch what a worker machine needs to start any tenant's job in its sandbox (operators only)",
}
DEFAULT_SCOPES = ("jobs", "read", "models", "tinker")


class KeyRequestError(ValueError):
    """A bad key request (unknown scope, bad tenant name); the message names the field."""


@dataclass(frozen=True)
class Caller:
    """Who is calling: the tenant the key acts for, the key's public id, and what it may do."""

    tenant: str
    key_id: str
    scopes: frozenset[str]


@dataclass(frozen=True)
class KeyInfo:
    """A key as listings show it (never the secret, never the hash)."""

    id: str
    tenant: str
    scopes: tuple[str, ...]
    label: str
    created_at: float
    revoked_at: float | None


def check_scopes(scopes: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    unknown = sorted(set(scopes) - set(SCOPES))
    if unknown:
        raise KeyRequestError(f"scope: unknown {unknown[0]!r} (expected any of {', '.join(SCOPES)})")
    if not scopes:
        raise KeyRequestError(f"scope: expected at least one of {', '.join(SCOPES)}")
    return tuple(sorted(set(scopes)))


def key_id_of(presented: str) -> str | None:
    """The public id inside a presented key, or None when it is not shaped like one of ours."""
    if not presented.startswith(PREFIX) or len(presented) > 200:
        return None
    key_id, sep, secret = presented.removeprefix(PREFIX).partition("_")
    return key_id if sep and key_id.isalnum() and secret else None


class KeyRing:
    """Creates, lists, revokes and checks the keys in a ``Store``."""

    def __init__(self, store: Store, negative_cache_size: int = 4096):
        self.store = store
        self._secret = secrets.token_bytes(32)
        self._accepted: dict[str, bytes] = {}
        self._rejected: OrderedDict[bytes, None] = OrderedDict()
        self._negative_cache_size = negative_cache_size
        self._lock = threading.Lock()

    def create(
        self, tenant: str, scopes: list[str] | tuple[str, ...] = DEFAULT_SCOPES, label: str = ""
    ) -> tuple[KeyInfo, str]:
        """A new key for ``tenant`` (made with default quotas when new): its info and the key, the only time it
        exists in clear."""
        check_name(tenant)
        scopes = check_scopes(scopes)
        key_id = secrets.token_hex(6)
        key = f"{PREFIX}{key_id}_{secrets.token_urlsafe(30)}"
        row = ApiKey(id=key_id, tenant=tenant, key_hash=hash_api_key(key), scopes=list(scopes), label=label)
        with self.store.session() as session:
            ensure_tenant(session, tenant)
            session.add(row)
        return _info(row), key

    def list(self, tenant: str | None = None) -> list[KeyInfo]:
        with self.store.session() as session:
            query = sa.select(ApiKey).order_by(ApiKey.created_at)
            if tenant is not None:
                query = query.where(ApiKey.tenant == tenant)
            return [_info(row) for row in session.scalars(query)]

    def revoke(self, key_id: str, tenant: str | None = None) -> KeyInfo | None:
        """Revoke a key (of ``tenant`` when given); None when there is no such key. Takes effect on the next request
        to every server process (each request reads the key's row)."""
        with self.store.session() as session:
            row = session.get(ApiKey, key_id)
            if row is None or (tenant is not None and row.tenant != tenant):
                return None
            if row.revoked_at is None:
                row.revoked_at = time.time()
            return _info(row)

    def authenticate(self, presented: str) -> Caller | None:
        """The caller a presented key stands for, or None (unknown, wrong or revoked)."""
        key_id = key_id_of(presented)
        if key_id is None:
            return None
        with self.store.session() as session:
            row = session.get(ApiKey, key_id)
            if row is None or row.revoked_at is not None:
                return None
            caller = Caller(row.tenant, row.id, frozenset(row.scopes))
            key_hash = row.key_hash
        fingerprint = hmac.new(self._secret, presented.encode(), hashlib.sha256).digest()
        if self._accepted.get(key_id) == fingerprint:
            return caller
        if fingerprint in self._rejected:
            return None
        with self._lock:  # scrypt is slow on purpose: one check at a time
            ok = verify_api_key(presented, key_hash)
            if ok:
                self._accepted[key_id] = fingerprint
            else:
                self._rejected[fingerprint] = None
                while len(self._rejected) > self._negative_cache_size:
                    self._rejected.popitem(last=False)
        return caller if ok else None


def _info(row: ApiKey) -> KeyInfo:
    return KeyInfo(row.id, row.tenant, tuple(row.scopes), row.label, row.created_at, row.revoked_at)
