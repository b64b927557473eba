"""``/v1/uploads``: a tenant's env code (a package archive or a wheel), checked and unpacked under its data dir."""

from __future__ import annotations

import hashlib
import logging
import secrets

import anyio.to_thread
import sqlalchemy as sa
from fastapi import APIRouter, Depends, HTTPException, Query, Request, status

from .. import tenants
from ..auth import Caller, require_scope
from ..db import Upload
from ..packaging import Limits, UploadError, show, unpack
from ..schemas import UploadOut

router = APIRouter(prefix="/v1/uploads", tags=["uploads"])
log = logging.getLogger(__name__)


@router.post(
    "",
    response_model=UploadOut,
    status_code=status.HTTP_201_CREATED,
    openapi_extra={"requestBody": {"content": {"application/octet-stream": {}}, "required": True}},
)
async def upload(
    request: Request,
    filename: str = Query(description="The archive's name: NAME.tar.gz, .tgz, .zip or .whl."),
    caller: Caller = Depends(require_scope("jobs")),
) -> UploadOut:
    """Store env code (the raw archive as the body). Refused with 422 naming the member and the limit: another
    format, a member with an absolute or '..' path, a link, a file and a folder of the same name, a corrupt member,
    too many members, too long a name, too deep a path, too many bytes unpacked (per member or in all); a body over
    the limit gets 413. The same archive again returns the upload it made."""
    settings = request.app.state.settings
    limit = int(settings.server_max_upload_mb * 1024 * 1024)
    data = await _read_body(request, limit)
    store = request.app.state.store

    def save() -> Upload:  # in a worker thread: hashing and unpacking never hold up the event loop
        digest = hashlib.sha256(data).hexdigest()
        with store.session() as session:
            same = session.scalars(
                sa.select(Upload).where(Upload.tenant == caller.tenant, Upload.sha256 == digest)
            ).first()
            if same is not None:
                return same
        upload_id = f"upl-{secrets.token_hex(6)}"
        root = settings.resolved_data_dir
        dest = tenants.uploads_dir(caller.tenant, settings) / upload_id
        try:
            packages = unpack(data, filename, dest, root=root, limits=Limits.for_body(limit))
        except UploadError as exc:
            message = str(exc)[:600]  # already one bounded line; cut again so no log line can be attacker-sized
            log.warning("upload of tenant %s refused (%s): %s", caller.tenant, show(filename), message)
            raise HTTPException(exc.status, message) from None
        row = Upload(
            id=upload_id, tenant=caller.tenant, sha256=digest, size=len(data), filename=filename, packages=packages
        )
        with store.session() as session:
            session.add(row)
        return row

    row = await anyio.to_thread.run_sync(save)
    return UploadOut.model_validate(row, from_attributes=True)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, counted as it streams in: past ``limit`` bytes a 413. What is left of it is read and dropped first
    (up to ``max(64 MiB, 8 x limit)``, then the connection is closed), so a client that sends its whole body before
    reading the answer still reads the 413 (the app's body-limit middleware does the same before this)."""
    chunks, size, drain = [], 0, max(64 << 20, 8 * limit)
    stream = request.stream()
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            chunks.clear()
            break
        chunks.append(chunk)
    else:
        return b"".join(chunks)
    finished = True
    async for chunk in stream:
        size += len(chunk)
        if size > drain:
            finished = False
            break
    raise HTTPException(
        status.HTTP_413_CONTENT_TOO_LARGE,
        f"request body: expected at most {limit} bytes",
        headers=None if finished else {"Connection": "close"},
    )
