"""The one authentication dependency every route but health uses: a key in, the ``Caller`` (tenant, key id, scopes)
out, or 401.

Keys travel as ``Authorization: Bearer <key>`` or ``X-API-Key: <key>`` (what the Tinker SDK sends). A missing scope
answers 403: the caller already proved who it is, and the resource is its own tenant's. Another tenant's resources
never get that far: routes look them up by (tenant, id) and answer 404, so ids do not leak by a 403.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio.to_thread
from fastapi import Depends, HTTPException, Request, status
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from .keys import Caller, KeyRing

__all__ = ["Caller", "current_caller", "require_scope"]

_bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer tml-...`")
_api_key_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="`X-API-Key: tml-...` (Tinker SDK)")
UNAUTHORIZED = "missing or invalid API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'"


async def current_caller(
    request: Request,
    bearer: HTTPAuthorizationCredentials | None = Depends(_bearer),
    api_key: str | None = Depends(_api_key_header),
) -> Caller:
    """The caller behind the request's key; 401 when there is none or it is unknown, wrong or revoked."""
    presented = bearer.credentials if bearer is not None else api_key
    caller = None
    if presented:
        keyring: KeyRing = request.app.state.keyring
        caller = await anyio.to_thread.run_sync(keyring.authenticate, presented.strip())
    if caller is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, UNAUTHORIZED, headers={"WWW-Authenticate": 'Bearer realm="opentinker"'}
        )
    request.state.caller = caller
    return caller


def require_scope(scope: str) -> Callable[..., Caller]:
    """A dependency: the caller, provided its key has ``scope`` (403 naming it otherwise)."""

    async def dependency(caller: Caller = Depends(current_caller)) -> Caller:
        if scope not in caller.scopes:
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                f"this key lacks the {scope!r} scope (it has: {', '.join(sorted(caller.scopes))})",
            )
        return caller

    dependency.__name__ = f"require_{scope}"
    return dependency
