"""User env code between laptop and server: packed by the client, unpacked by the server only when it is safe.

The client packs the top-level package of ``package.module:Class`` (its folder, as a ``.tar.gz``), or a wheel the
user names. The server refuses an archive that could write outside its folder or point elsewhere: absolute paths,
``..`` parts, symbolic and hard links, devices, more than ``MAX_MEMBERS`` members, or more bytes unpacked than the
upload limit (a compression bomb). Standard library only: the client imports it.
"""

from __future__ import annotations

import importlib.util
import io
import stat
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".zip", ".whl")
MAX_MEMBERS = 10_000
SKIPPED = ("__pycache__", ".git", ".mypy_cache", ".pytest_cache", ".ruff_cache")


class UploadError(ValueError):
    """An archive that cannot be used; the message names what is wrong with it."""


def top_package(env_id: str) -> str | None:
    """The top-level package of ``package.module:Class`` (None for a gymnasium id)."""
    if ":" not in env_id:
        return None
    return env_id.split(":", 1)[0].split(".", 1)[0]


def pack_package(name: str) -> tuple[bytes, str]:
    """A ``.tar.gz`` of the importable top-level package (or module) ``name`` as the client finds it, and its file
    name. Links and caches are left out."""
    spec = importlib.util.find_spec(name)
    if spec is None or (spec.origin is None and not spec.submodule_search_locations):
        raise UploadError(f"env_id: package {name!r} is not importable here (run from its parent folder)")
    if spec.submodule_search_locations:
        root = Path(next(iter(spec.submodule_search_locations)))
    else:
        root = Path(spec.origin)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        paths = [root] if root.is_file() else sorted(root.rglob("*"))
        for path in paths:
            relative = path.relative_to(root.parent)
            if path.is_symlink() or any(part in SKIPPED for part in relative.parts) or path.suffix == ".pyc":
                continue
            archive.add(path, arcname=relative.as_posix(), recursive=False)
    return buffer.getvalue(), f"{name}.tar.gz"


def unpack(data: bytes, filename: str, dest: Path, max_bytes: int) -> list[str]:
    """Unpack an upload into ``dest`` (a new folder) after checking every member; returns its top-level packages and
    modules. Nothing is written when a member is refused."""
    if not filename.endswith(ARCHIVE_SUFFIXES):
        raise UploadError(f"filename: expected an archive ending in {', '.join(ARCHIVE_SUFFIXES)} (got {filename!r})")
    try:
        if filename.endswith((".tar.gz", ".tgz")):
            members = _tar_members(data, max_bytes)
        else:
            members = _zip_members(data, max_bytes)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as exc:
        raise UploadError(f"upload: {filename!r} is not a readable archive ({exc})") from None
    dest.mkdir(parents=True)
    for name, _, read in members:
        if name.endswith("/"):
            (dest / name).mkdir(parents=True, exist_ok=True)
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(read())
    return sorted(
        path.name if path.is_dir() else path.stem
        for path in dest.iterdir()
        if (path.is_dir() and not path.name.endswith((".dist-info", ".data"))) or path.suffix == ".py"
    )


def _checked_name(name: str) -> str:
    path = PurePosixPath(name)
    if not name or path.is_absolute() or "\\" in name or any(part == ".." for part in path.parts) or ":" in name:
        raise UploadError(f"upload: member {name!r} would land outside the archive's folder (absolute or '..' path)")
    return name


def _budget(members: list, size: int, max_bytes: int) -> None:
    """Refuse the archive as soon as its members or their declared sizes pass the limits (before reading them)."""
    if len(members) >= MAX_MEMBERS:
        raise UploadError(f"upload: more than {MAX_MEMBERS} members, expected at most {MAX_MEMBERS}")
    if sum(m[1] for m in members) + size > max_bytes:
        raise UploadError(f"upload: unpacks to more than {max_bytes} bytes, expected at most {max_bytes}")


def _tar_members(data: bytes, max_bytes: int) -> list:
    members = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        for member in archive:
            name = _checked_name(member.name)
            _budget(members, member.size, max_bytes)
            if member.issym() or member.islnk():
                raise UploadError(f"upload: member {name!r} is a link; links are refused")
            if member.isdir():
                members.append((name.rstrip("/") + "/", 0, None))
            elif member.isfile():
                content = archive.extractfile(member).read()
                members.append((name, len(content), lambda content=content: content))
            else:
                raise UploadError(f"upload: member {name!r} is not a regular file or folder")
    return members


def _zip_members(data: bytes, max_bytes: int) -> list:
    archive = zipfile.ZipFile(io.BytesIO(data))
    members = []
    for info in archive.infolist():
        name = _checked_name(info.filename)
        _budget(members, info.file_size, max_bytes)
        mode = info.external_attr >> 16
        if stat.S_ISLNK(mode):
            raise UploadError(f"upload: member {name!r} is a link; links are refused")
        if mode and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise UploadError(f"upload: member {name!r} is not a regular file or folder")
        members.append((name, info.file_size, lambda info=info: archive.read(info)))
    return members
