"""``/v1/uploads``: a tenant's env code (a package archive or a wheel), checked and unpacked under its data dir."""

from __future__ import annotations

import hashlib
import secrets
import shutil

import anyio.to_thread
import sqlalchemy as sa
from fastapi import APIRouter, Depends, HTTPException, Query, Request, status

from .. import tenants
from ..auth import Caller, require_scope
from ..db import Upload
from ..packaging import UploadError, unpack
from ..schemas import UploadOut

router = APIRouter(prefix="/v1/uploads", tags=["uploads"])


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
    """Store env code (the raw archive as the body). Refused with 422 naming the problem: another format, a member
    with an absolute or '..' path, a link, too many members or bytes; a body over the limit gets 413. The same archive
    again returns the upload it made."""
    data = await request.body()
    settings = request.app.state.settings
    limit = int(settings.server_max_upload_mb * 1024 * 1024)
    digest = hashlib.sha256(data).hexdigest()
    store = request.app.state.store

    def save() -> Upload:
        with store.session() as session:
            same = session.scalars(
                sa.select(Upload).where(Upload.tenant == caller.tenant, Upload.sha256 == digest)
            ).first()
            if same is not None:
                return same
        upload_id = f"upl-{secrets.token_hex(6)}"
        dest = tenants.uploads_dir(caller.tenant, settings) / upload_id
        try:
            packages = unpack(data, filename, dest, max_bytes=limit)
        except UploadError as exc:
            shutil.rmtree(dest, ignore_errors=True)
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from None
        row = Upload(
            id=upload_id, tenant=caller.tenant, sha256=digest, size=len(data), filename=filename, packages=packages
        )
        with store.session() as session:
            session.add(row)
        return row

    row = await anyio.to_thread.run_sync(save)
    return UploadOut.model_validate(row, from_attributes=True)
