"""User env code between laptop and server: packed by the client, unpacked by the server as hostile input.

The client packs the top-level package of ``package.module:Class`` (its folder, as a ``.tar.gz``), or a wheel the
user names. The server refuses an archive that could write outside its folder or point elsewhere (absolute paths,
``..`` parts, symbolic and hard links, devices) and one that passes any of ``Limits`` (members, name length, path
depth, bytes per member and in all). The limits hold while the archive is read, before memory or disk grows: the
decompressed stream is counted as it is read, a tar's long-name and PAX headers are sized before they are read, a
zip's central directory is counted before it is parsed and its members' declared sizes are not believed (their
actual bytes are counted). Members are written into a fresh ``.partial-<id>`` folder, reached without following
links, and renamed into place only once all of them are in; any refusal removes it. Standard library only: the
client imports it.
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import os
import re
import shutil
import stat
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from opentinker.infra.files import DIR_FLAGS, LinkRefusedError, open_dir_nofollow

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".zip", ".whl")
MAX_MEMBERS = 10_000
SKIPPED = ("__pycache__", ".git", ".mypy_cache", ".pytest_cache", ".ruff_cache")
CHUNK = 64 << 10
"""Bytes read (and decompressed) at a time: no read of the archive is ever larger."""
SHOWN = 100
"""Characters of a member's name shown in a message (its length in bytes follows when cut)."""


@dataclass(frozen=True)
class Limits:
    """What one upload may hold once unpacked; each is enforced while the archive is read."""

    total_bytes: int = 64 << 20
    """Bytes unpacked in all (a tar: its whole decompressed stream, headers included)."""
    member_bytes: int = 32 << 20
    """Bytes of one member."""
    members: int = MAX_MEMBERS
    """Members (files and folders)."""
    name_bytes: int = 1024
    """Bytes (UTF-8) of a member's whole name."""
    part_bytes: int = 255
    """Bytes of one part of a name (a file or folder name; most file systems' own limit)."""
    depth: int = 32
    """Parts of one name (folders deep)."""
    header_bytes: int = 64 << 10
    """Bytes of one tar PAX header (a member's name, times, owners)."""

    @classmethod
    def for_body(cls, max_bytes: int) -> Limits:
        """The server's limits for a body limit of ``max_bytes``: as many bytes unpacked in all, at most 32 MiB of
        them in one member."""
        return cls(total_bytes=max_bytes, member_bytes=min(max_bytes, cls.member_bytes))


class UploadError(ValueError):
    """An archive that cannot be used; the message (one line, bounded) names the member and the limit."""

    status = 422
    """The HTTP status the server answers with."""


class UploadFolderError(UploadError):
    """The tenant's uploads folder (or a folder above it) is a symbolic link or not a folder: refused, not
    followed."""

    status = 409


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


def unpack(data: bytes, filename: str, dest: Path, *, root: Path, limits: Limits | None = None) -> list[str]:
    """Unpack an upload into ``dest`` (a new folder under ``root``) and return its top-level packages and modules.

    ``root`` is the trusted folder (the server's data dir) from which every folder down to ``dest``'s parent is
    opened without following links (made when missing); the members go to a fresh ``.partial-<name>`` sibling that
    is renamed to ``dest`` only when all of them are in. Any refusal (``UploadError``, a one-line message naming the
    member and the limit) removes it: nothing is left behind.
    """
    limits = limits or Limits()
    if not filename.endswith(ARCHIVE_SUFFIXES):
        raise UploadError(
            f"filename: expected an archive ending in {', '.join(ARCHIVE_SUFFIXES)} (got {show(filename)})"
        )
    relative = dest.relative_to(root)
    try:
        # The tenant's folders as the umask allows (group-writable under 002): workers of the operator's group, as
        # users of their own, make the tenant's runs/ beside uploads/.
        parent = open_dir_nofollow(root, relative.parent, create=True, mode=0o775)
    except LinkRefusedError as exc:
        raise UploadFolderError(f"upload: the uploads folder cannot be used: {exc}") from None
    partial = f".partial-{dest.name}"
    try:
        os.mkdir(partial, 0o755, dir_fd=parent)
        checker = _Checker(limits)
        folder = os.open(partial, DIR_FLAGS, dir_fd=parent)
        try:
            _unpack_into(data, filename, _Writer(folder, checker))
        finally:
            os.close(folder)
        os.rename(partial, dest.name, src_dir_fd=parent, dst_dir_fd=parent)
    except BaseException:
        shutil.rmtree(partial, dir_fd=parent, ignore_errors=True)
        raise
    finally:
        os.close(parent)
    return checker.packages()


def show(name: str | bytes, size: int | None = None) -> str:
    """A member's name for a message: quoted, cut to ``SHOWN`` characters, then its length in bytes when cut (or when
    ``size`` says that only a prefix was read)."""
    text = name.decode("utf-8", "replace") if isinstance(name, bytes) else name
    if size is None:
        size = len(name) if isinstance(name, bytes) else len(name.encode("utf-8", "surrogateescape"))
    shown = text[:SHOWN]
    if size > len(shown.encode("utf-8", "surrogateescape")):
        return f"{shown!r}... ({size} bytes)"
    return repr(shown)


def _clip(exc: BaseException) -> str:
    """An exception from a parser as a bounded, one-line text (its message may quote the archive)."""
    text = " ".join(str(exc)[:400].split())
    return f"{type(exc).__name__}: {text[:200]}{'...' if len(text) > 200 else ''}"


def _unpack_into(data: bytes, filename: str, writer: _Writer) -> None:
    try:
        if filename.endswith((".tar.gz", ".tgz")):
            _unpack_tar(data, writer)
        else:
            _unpack_zip(data, writer)
    except (UploadError, _WriteFailed):
        raise
    except Exception as exc:  # whatever a parser of hostile bytes raises is the archive's fault
        raise UploadError(f"upload: {show(filename)} is not a readable archive ({_clip(exc)})") from None


class _WriteFailed(RuntimeError):
    """Writing a checked member failed on the server's side (a full disk): a 500, not the archive's fault."""


class _Checker:
    """Every member's name, kind and bytes against the limits, in archive order, before it is written."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.kinds: dict[tuple[str, ...], str] = {}  # each path seen, its own or as a folder above another: file|dir
        self.listed: set[tuple[str, ...]] = set()
        self.count = 0
        self.declared = 0
        self.written = 0

    def add(self, name: str, kind: str) -> tuple[str, ...]:
        """The name's parts once it is a new member within the limits that collides with none before it."""
        limits = self.limits
        self.count += 1
        if self.count > limits.members:
            raise UploadError(f"upload: member {show(name)} is one too many: expected at most {limits.members} members")
        size = len(name.encode("utf-8", "surrogateescape"))
        if size > limits.name_bytes:
            raise UploadError(f"upload: member {show(name)}: name longer than {limits.name_bytes} bytes, the limit")
        path = PurePosixPath(name)
        if path.is_absolute() or "\\" in name or ":" in name or any(part == ".." for part in path.parts):
            raise UploadError(
                f"upload: member {show(name)} would land outside the archive's folder (absolute or '..' path)"
            )
        if any(ord(char) < 32 or ord(char) == 127 for char in name):
            raise UploadError(f"upload: member {show(name)}: a control character in its name is refused")
        parts = path.parts
        if not parts:
            raise UploadError(f"upload: member {show(name)} has an empty name")
        if len(parts) > limits.depth:
            raise UploadError(
                f"upload: member {show(name)} is {len(parts)} levels deep; expected at most {limits.depth} levels"
            )
        for part in parts:
            if len(part.encode("utf-8", "surrogateescape")) > limits.part_bytes:
                raise UploadError(
                    f"upload: member {show(name)}: the part {show(part)} is longer than {limits.part_bytes} bytes,"
                    " the limit per file or folder name"
                )
        for depth in range(1, len(parts)):
            above = parts[:depth]
            if self.kinds.setdefault(above, "dir") == "file":
                raise UploadError(
                    f"upload: member {show(name)} is inside {show('/'.join(above))}, an earlier member that is a"
                    " file (a file and a folder of the same name)"
                )
        earlier = self.kinds.setdefault(parts, kind)
        if earlier != kind:
            raise UploadError(
                f"upload: member {show(name)} is a {'file' if kind == 'file' else 'folder'}, but an earlier member"
                f" {'made it a folder' if earlier == 'dir' else 'is a file of that name'} (a file and a folder of the"
                " same name)"
            )
        if parts in self.listed:
            raise UploadError(f"upload: member {show(name)} appears twice")
        self.listed.add(parts)
        return parts

    def declare(self, name: str, size: int) -> None:
        """Refuse a member by the size its header declares, before reading it (its bytes are counted too)."""
        if size > self.limits.member_bytes:
            raise UploadError(self._member_message(name))
        self.declared += size
        if self.declared > self.limits.total_bytes:
            raise UploadError(self._total_message(name))

    def spend(self, name: str, member_bytes: int, more: int) -> None:
        """Count ``more`` bytes just unpacked of the member (``member_bytes`` of it so far)."""
        if member_bytes > self.limits.member_bytes:
            raise UploadError(self._member_message(name))
        self.written += more
        if self.written > self.limits.total_bytes:
            raise UploadError(self._total_message(name))

    def _member_message(self, name: str) -> str:
        limit = self.limits.member_bytes
        return f"upload: member {show(name)} unpacks to more than {limit} bytes; expected at most {limit} per member"

    def _total_message(self, name: str) -> str:
        limit = self.limits.total_bytes
        return f"upload: member {show(name)} takes the archive past {limit} bytes unpacked; expected at most {limit}"

    def packages(self) -> list[str]:
        """Top-level packages (folders other than a wheel's ``.dist-info``/``.data``) and modules (``.py`` files)."""
        names = []
        for parts, kind in self.kinds.items():
            if len(parts) != 1:
                continue
            (name,) = parts
            if kind == "dir" and not name.endswith((".dist-info", ".data")):
                names.append(name)
            elif kind == "file" and name.endswith(".py"):
                names.append(name[: -len(".py")])
        return sorted(names)


class _Writer:
    """Writes checked members under one open folder, through descriptors only: no link is followed, no file that
    exists is replaced."""

    def __init__(self, folder: int, checker: _Checker):
        self.folder = folder
        self.checker = checker

    def add(self, name: str, kind: str, source=None) -> int:
        """Check the member (``checker.add``), then make the folder or copy ``source`` (read in chunks) into it;
        returns the bytes copied."""
        parts = self.checker.add(name, kind)
        try:
            parent = open_dir_nofollow(self.folder, "/".join(parts[:-1] if kind == "file" else parts), create=True)
        except OSError as exc:
            raise _WriteFailed(f"upload: cannot make the folder of member {show(name)} ({_clip(exc)})") from None
        try:
            return self._copy(name, parts[-1], parent, source) if kind == "file" else 0
        finally:
            os.close(parent)

    def _copy(self, name: str, leaf: str, parent: int, source) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            out = os.fdopen(os.open(leaf, flags, 0o644, dir_fd=parent), "wb")
        except OSError as exc:
            raise _WriteFailed(f"upload: cannot write member {show(name)} ({_clip(exc)})") from None
        with out:
            size = 0
            while chunk := source.read(CHUNK):
                size += len(chunk)
                self.checker.spend(name, size, len(chunk))
                try:
                    out.write(chunk)
                except OSError as exc:
                    raise _WriteFailed(f"upload: cannot write member {show(name)} ({_clip(exc)})") from None
        return size


class _Counted(io.RawIOBase):
    """The decompressed stream, read ``CHUNK`` bytes at a time whatever the caller asks, that refuses the archive
    as soon as more than ``limit`` bytes came out: a bomb (or a giant header) stops here, before memory grows."""

    def __init__(self, raw, limit: int):
        self.raw = raw
        self.limit = limit
        self.total = 0
        self.after = ""
        """The last member seen, for the message."""

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(CHUNK if size is None or size < 0 else min(size, CHUNK))
        self.total += len(data)
        if self.total > self.limit:
            where = f" after member {show(self.after)}" if self.after else " in its first member's headers"
            raise UploadError(
                f"upload: the archive unpacks to more than {self.limit} bytes{where}; expected at most {self.limit}"
            )
        return data


class _CheckedTarInfo(tarfile.TarInfo):
    """A tar header that sizes a GNU long name and a PAX header before reading them: a name of a GiB is refused
    from the first bytes of it (tarfile would read it whole, then fail on it)."""

    limits = Limits()

    def _proc_gnulong(self, tarfile):
        limit = self.limits.name_bytes
        if self.size > limit + 1:  # the name and its NUL
            prefix = tarfile.fileobj.read(min(self.size, 4 * SHOWN)).split(b"\0", 1)[0]
            raise UploadError(
                f"upload: member {show(prefix, self.size - 1)}: name longer than {limit} bytes, the limit"
                " (a GNU long-name header)"
            )
        return super()._proc_gnulong(tarfile)

    def _proc_pax(self, tarfile):
        limit = self.limits.header_bytes
        if self.size > limit:
            prefix = tarfile.fileobj.read(min(self.size, 4096))
            record = re.search(rb"(?:^|\n)(\d{1,20}) path=", prefix)
            if record:
                name_size = int(record[1]) - len(record[0].lstrip(b"\n")) - 1
                member = show(prefix[record.end() :].split(b"\n", 1)[0], max(name_size, 0))
            else:
                member = "(its name not within the header's first 4096 bytes)"
            raise UploadError(
                f"upload: member {member} has a PAX header of {self.size} bytes; expected at most {limit} (names of"
                f" at most {self.limits.name_bytes} bytes)"
            )
        return super()._proc_pax(tarfile)

    def _proc_sparse(self, tarfile):
        # refused before its (unbounded) chain of extension blocks is read
        raise UploadError(
            f"upload: member {show(self.name)} is a sparse file; only regular files and folders are taken"
        )


def _unpack_tar(data: bytes, writer: _Writer) -> None:
    limits = writer.checker.limits
    stream = _Counted(gzip.GzipFile(fileobj=io.BytesIO(data), mode="rb"), limits.total_bytes)
    tarinfo = type("_Limited", (_CheckedTarInfo,), {"limits": limits})
    with tarfile.open(fileobj=stream, mode="r|", tarinfo=tarinfo) as archive:
        for member in archive:
            stream.after = member.name
            name = member.name
            if member.issym() or member.islnk():
                raise UploadError(f"upload: member {show(name)} is a link; links are refused")
            if member.isdir():
                writer.add(name, "dir")
            elif member.isfile() and not member.issparse():
                writer.checker.declare(name, member.size)
                writer.add(name, "file", archive.extractfile(member))
            else:
                raise UploadError(f"upload: member {show(name)} is not a regular file or folder")


def _unpack_zip(data: bytes, writer: _Writer) -> None:
    limits = writer.checker.limits
    _count_directory(data, limits)
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        _unpack_zip_members(archive, writer)


def _unpack_zip_members(archive: zipfile.ZipFile, writer: _Writer) -> None:
    """Every member's name, kind and declared size first, then each member's actual bytes, counted as written."""
    limits = writer.checker.limits
    infos = archive.infolist()
    if len(infos) > limits.members:
        raise UploadError(
            f"upload: member {show(infos[limits.members].filename)} is one too many: expected at most"
            f" {limits.members} members"
        )
    for info in infos:  # every name, kind and declared size before the first byte is written
        name, mode = info.filename, info.external_attr >> 16
        if stat.S_ISLNK(mode):
            raise UploadError(f"upload: member {show(name)} is a link; links are refused")
        if stat.S_IFMT(mode) and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise UploadError(f"upload: member {show(name)} is not a regular file or folder")
        if info.flag_bits & 0x1:
            raise UploadError(f"upload: member {show(name)} is encrypted; encrypted members are refused")
        if not info.is_dir():
            writer.checker.declare(name, info.file_size)
    check = _Checker(limits)  # names and collisions of the whole listing, then again member by member as written
    for info in infos:
        check.add(info.filename, "dir" if info.is_dir() else "file")
    for info in infos:
        name = info.filename
        if info.is_dir():
            writer.add(name, "dir")
            continue
        try:
            with archive.open(info) as source:
                size = writer.add(name, "file", source)
        except (zipfile.BadZipFile, EOFError, OSError, ValueError, NotImplementedError, RuntimeError) as exc:
            if isinstance(exc, (UploadError, _WriteFailed)):
                raise
            raise UploadError(
                f"upload: member {show(name)} cannot be read, corrupt or truncated ({_clip(exc)})"
            ) from None
        if size != info.file_size:
            raise UploadError(f"upload: member {show(name)} declares {info.file_size} bytes but unpacks to {size}")


def _count_directory(data: bytes, limits: Limits) -> None:
    """Refuse a zip whose central directory lists more than ``limits.members`` entries before ``zipfile`` builds an
    object for each (a 64 MiB directory holds over a million)."""
    end = zipfile._EndRecData(io.BytesIO(data))  # the end record zipfile itself reads: where its directory lies
    if end is None:
        raise UploadError("upload: not a readable archive (no zip end-of-directory record)")
    size = end[zipfile._ECD_SIZE]
    start = end[zipfile._ECD_LOCATION] - size
    if end[zipfile._ECD_SIGNATURE] == zipfile.stringEndArchive64:
        start -= zipfile.sizeEndCentDir64 + zipfile.sizeEndCentDir64Locator
    declared = end[zipfile._ECD_ENTRIES_TOTAL]
    # every entry starts with this signature (a name holding it only makes the count larger)
    found = data.count(zipfile.stringCentralDir, max(start, 0), max(start, 0) + size)
    if max(declared, found) > limits.members:
        raise UploadError(
            f"upload: the zip lists {max(declared, found)} members; expected at most {limits.members} members"
        )
