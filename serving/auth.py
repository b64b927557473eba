"""API-key authentication for OpenTinker's HTTP services (BentoML OSS ships none).

Keys are never stored or handed to a server process in clear: the parent hashes the key with scrypt
(salted, so a leaked hash does not reveal a short key) and passes only the hash, through the
``OPENTINKER_SERVE_API_KEY_HASH`` environment variable or a file named by
``OPENTINKER_SERVE_API_KEY_HASH_FILE``. The server compares in constant time (``hmac.compare_digest``)
and never logs or echoes a presented key.

scrypt costs ~60 ms, so a verified key is remembered by a keyed digest (an HMAC under a per-process
random secret, never the key itself); rejected keys are remembered in a bounded cache and fresh wrong
keys are checked one at a time in a worker thread, so a flood of bad keys cannot stall the event loop.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import threading
from collections import OrderedDict
from pathlib import Path

from opentinker.infra.files import atomic_write

HASH_ENV = "OPENTINKER_SERVE_API_KEY_HASH"
HASH_FILE_ENV = "OPENTINKER_SERVE_API_KEY_HASH_FILE"
API_KEY_ENV = "OPENTINKER_API_KEY"
MIN_KEY_LENGTH = 6
HEALTH_PATHS = frozenset({"/healthz", "/livez", "/readyz"})

_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 2**14, 8, 1


class ApiKeyError(ValueError):
    """A key or key hash is missing or malformed (the message never contains the key)."""


def hash_api_key(api_key: str) -> str:
    """Salted scrypt hash in the form ``scrypt$N$r$p$salt_hex$digest_hex``."""
    _check_key(api_key)
    salt = secrets.token_bytes(16)
    digest = hashlib.scrypt(api_key.encode(), salt=salt, n=_SCRYPT_N, r=_SCRYPT_R, p=_SCRYPT_P, dklen=32)
    return f"scrypt${_SCRYPT_N}${_SCRYPT_R}${_SCRYPT_P}${salt.hex()}${digest.hex()}"


def verify_api_key(api_key: str, key_hash: str) -> bool:
    """True when ``api_key`` matches ``key_hash``; constant-time comparison of the digests."""
    n, r, p, salt, expected = _parse_hash(key_hash)
    digest = hashlib.scrypt(api_key.encode(), salt=salt, n=n, r=r, p=p, dklen=len(expected))
    return hmac.compare_digest(digest, expected)


def _check_key(api_key: str) -> None:
    if not isinstance(api_key, str) or len(api_key) < MIN_KEY_LENGTH:
        raise ApiKeyError(f"api_key: expected a string of at least {MIN_KEY_LENGTH} characters")
    if api_key != api_key.strip() or any(c.isspace() for c in api_key):
        raise ApiKeyError("api_key: expected no whitespace (it travels in an HTTP header)")


def _parse_hash(key_hash: str) -> tuple[int, int, int, bytes, bytes]:
    parts = key_hash.strip().split("$")
    if len(parts) != 6 or parts[0] != "scrypt":
        raise ApiKeyError("api key hash: expected 'scrypt$N$r$p$salt_hex$digest_hex' (made by hash_api_key)")
    try:
        return int(parts[1]), int(parts[2]), int(parts[3]), bytes.fromhex(parts[4]), bytes.fromhex(parts[5])
    except ValueError as exc:
        raise ApiKeyError("api key hash: malformed numbers or hex in 'scrypt$N$r$p$salt_hex$digest_hex'") from exc


def resolve_api_key(api_key: str | None = None, api_key_file: str | Path | None = None) -> str:
    """The key for a CLI command: ``--api-key``, else ``--api-key-file``, else ``$OPENTINKER_API_KEY``."""
    if api_key and api_key_file:
        raise ApiKeyError("give either --api-key or --api-key-file, not both")
    if api_key_file:
        path = Path(api_key_file)
        if not path.is_file():
            raise ApiKeyError(f"--api-key-file: no such file: {path}")
        api_key = path.read_text().strip()
    api_key = api_key or os.environ.get(API_KEY_ENV, "")
    if not api_key:
        raise ApiKeyError(f"an API key is required: --api-key, --api-key-file or ${API_KEY_ENV}")
    _check_key(api_key)
    return api_key


def write_key_hash_file(key_hash: str, path: str | Path) -> Path:
    """Persist a hash (never a key) atomically, readable only by the owner."""
    _parse_hash(key_hash)
    return atomic_write(path, key_hash + "\n", mode=0o600)


def key_hash_from_env() -> str:
    """The server side: the hash handed over by the parent (``OPENTINKER_SERVE_API_KEY_HASH[_FILE]``)."""
    from .config import get_serve_settings

    settings = get_serve_settings()
    key_hash = settings.api_key_hash.strip()
    if not key_hash and settings.api_key_hash_file:
        key_hash = Path(settings.api_key_hash_file).read_text().strip()
    if not key_hash:
        raise ApiKeyError(f"no API key hash: set {HASH_ENV} or {HASH_FILE_ENV} (see serving.auth.hash_api_key)")
    for one in key_hash.split():
        _parse_hash(one)
    return key_hash


class ApiKeyVerifier:
    """Checks presented keys against a hash (or several, whitespace-separated: any matches), caching outcomes by a
    keyed digest of the key."""

    def __init__(self, key_hash: str, negative_cache_size: int = 1024):
        self._key_hashes = key_hash.split()
        if not self._key_hashes:
            raise ApiKeyError("api key hash: expected at least one 'scrypt$N$r$p$salt_hex$digest_hex'")
        for one in self._key_hashes:
            _parse_hash(one)
        self._secret = secrets.token_bytes(32)
        self._accepted: set[bytes] = set()
        self._rejected: OrderedDict[bytes, None] = OrderedDict()
        self._negative_cache_size = negative_cache_size
        self._lock = threading.Lock()

    def _fingerprint(self, api_key: str) -> bytes:
        return hmac.new(self._secret, api_key.encode(), hashlib.sha256).digest()

    def cached(self, api_key: str) -> bool | None:
        """True/False when this key was seen before, None when it needs the slow check."""
        fp = self._fingerprint(api_key)
        if fp in self._accepted:
            return True
        return False if fp in self._rejected else None

    def verify(self, api_key: str) -> bool:
        """Slow path (scrypt); serialised so bad keys use at most one core."""
        fp = self._fingerprint(api_key)
        with self._lock:
            ok = any(verify_api_key(api_key, one) for one in self._key_hashes)
            if ok:
                self._accepted.add(fp)
            else:
                self._rejected[fp] = None
                while len(self._rejected) > self._negative_cache_size:
                    self._rejected.popitem(last=False)
        return ok


class ApiKeyMiddleware:
    """ASGI middleware: ``Authorization: Bearer <key>`` on every path except health checks, else 401."""

    def __init__(self, app, key_hash: str | None = None, exempt_paths: frozenset[str] = HEALTH_PATHS):
        self.app = app
        self.verifier = ApiKeyVerifier(key_hash or key_hash_from_env())
        self.exempt_paths = exempt_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.exempt_paths:
            return await self.app(scope, receive, send)
        if await self._authorized(scope):
            return await self.app(scope, receive, send)
        await _send_json(
            send,
            401,
            {"error": "missing or invalid API key: send 'Authorization: Bearer <key>'"},
            extra_headers=[(b"www-authenticate", b'Bearer realm="opentinker"')],
        )

    async def _authorized(self, scope) -> bool:
        presented = _bearer_token(scope)
        if presented is None:
            return False
        known = self.verifier.cached(presented)
        if known is not None:
            return known
        import anyio.to_thread

        return await anyio.to_thread.run_sync(self.verifier.verify, presented)


def _bearer_token(scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            token = token.strip()
            return token if scheme.lower() == "bearer" and token else None
    return None


async def _send_json(send, status: int, body: dict, extra_headers: list[tuple[bytes, bytes]] = ()) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()), *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
