"""The one way to write a file that a crash or a concurrent reader must only ever see whole (stdlib only)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def atomic_write(
    path: str | os.PathLike, data: bytes | str | Callable[[IO[bytes]], Any], mode: int | None = None
) -> Path:
    """Write ``data`` (bytes, text as UTF-8, or a function writing to a binary handle) to ``path`` atomically.

    A temp file in the same directory is written, fsynced and renamed over ``path`` (then the directory is
    fsynced), so readers and a crash at any moment see the old file or the new one, never a torn one. ``mode``
    (e.g. ``0o600`` for keys) is set before the first byte is written; without it the umask decides, as for
    ``open``. On any error the temp file is removed and the old file is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if mode is not None else 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            if mode is not None:
                os.fchmod(handle.fileno(), mode)
            if callable(data):
                data(handle)
            else:
                handle.write(data.encode() if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return path
