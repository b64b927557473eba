"""``/v1/keys``: API keys. Admins make, list and revoke keys of any tenant; any key lists its own tenant's keys."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Request, status

from ..auth import Caller, current_caller, require_scope
from ..keys import KeyInfo, KeyRequestError
from ..schemas import KeyCreate, KeyCreated, KeyOut, Whoami
from ..tenants import TenantError

router = APIRouter(prefix="/v1", tags=["keys"])


def _out(info: KeyInfo) -> dict:
    return {**info.__dict__, "scopes": list(info.scopes)}


@router.get("/whoami", response_model=Whoami)
def whoami(caller: Caller = Depends(current_caller)) -> Whoami:
    """The tenant, key id and scopes of the key this request carries."""
    return Whoami(tenant=caller.tenant, key_id=caller.key_id, scopes=sorted(caller.scopes))


@router.post("/keys", response_model=KeyCreated, status_code=status.HTTP_201_CREATED)
def create_key(body: KeyCreate, request: Request, caller: Caller = Depends(require_scope("admin"))) -> dict:
    """A new key for a tenant; the answer holds the key, the only time it is shown."""
    try:
        info, key = request.app.state.keyring.create(body.tenant, body.scopes, body.label)
    except (KeyRequestError, TenantError) as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from None
    return {**_out(info), "key": key}


@router.get("/keys", response_model=list[KeyOut])
def list_keys(request: Request, caller: Caller = Depends(current_caller)) -> list[dict]:
    """Every key's id, tenant, scopes and dates (admin: of every tenant); never a secret or a hash."""
    tenant = None if "admin" in caller.scopes else caller.tenant
    return [_out(info) for info in request.app.state.keyring.list(tenant)]


@router.delete("/keys/{key_id}", response_model=KeyOut)
def revoke_key(key_id: str, request: Request, caller: Caller = Depends(require_scope("admin"))) -> dict:
    """Revoke a key; every server process refuses it from the next request on."""
    info = request.app.state.keyring.revoke(key_id)
    if info is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"key {key_id!r} not found")
    return _out(info)
