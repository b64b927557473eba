"""The one way to write a file that a crash or a concurrent reader must only ever see whole, and the one way to reach
a folder without following links someone else may have planted (stdlib only)."""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path, PurePosixPath
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


class LinkRefusedError(OSError):
    """A path component that must be a real folder is a symbolic link (or not a folder at all): refused, not
    followed."""


DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""``os.open`` flags for a folder reached without following a link (use with ``dir_fd``)."""


def open_dir_nofollow(
    root: str | os.PathLike | int, relative: str | os.PathLike = "", *, create: bool = False, mode: int = 0o755
) -> int:
    """A descriptor of the folder ``root/relative``, reached without following any link below ``root``.

    ``root`` is trusted (a path no untrusted code can change, such as the server's data dir, opened as given; or an
    open folder descriptor, left open). Each component of ``relative`` is opened with ``O_NOFOLLOW|O_DIRECTORY``
    relative to the one before it (``openat``), so a component that a job (or anyone who can write its parent)
    replaced with a symbolic link raises ``LinkRefusedError`` wherever the link points, instead of leading the
    caller into another tenant's folder. Missing components are made (``mode``) when ``create``. ``..`` and absolute
    paths are refused. The caller closes the descriptor and acts inside it with ``dir_fd=`` calls (``os.open``,
    ``os.mkdir``, ``os.rename``, ``shutil.rmtree``), which never leave it either.
    """
    parts = PurePosixPath(os.fspath(relative)).parts
    if parts and (parts[0] == "/" or ".." in parts):
        raise ValueError(f"relative: expected a path inside the root without '..' (got {os.fspath(relative)[:200]!r})")
    current = os.dup(root) if isinstance(root, int) else os.open(root, DIR_FLAGS & ~os.O_NOFOLLOW)
    try:
        for depth, part in enumerate(parts):
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=current)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, mode, dir_fd=current)
                except FileExistsError:  # made meanwhile: opened (and checked) below like any other
                    pass
                child = os.open(part, DIR_FLAGS, dir_fd=current)
            except OSError as exc:
                if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise
                shown = "/".join(parts[: depth + 1])
                if stat.S_ISLNK(os.stat(part, dir_fd=current, follow_symlinks=False).st_mode):
                    raise LinkRefusedError(
                        f"{shown[:200]!r} is a symbolic link; refused, links there are never followed"
                    ) from None
                raise LinkRefusedError(f"{shown[:200]!r} is not a folder") from None
            os.close(current)
            current = child
    except BaseException:
        os.close(current)
        raise
    return current
