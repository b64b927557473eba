"""Uploads are parsed as hostile: every archive attack is refused while it is read, with a one-line message naming the
member and the limit, and leaves nothing on disk; the server answers 422 and keeps answering ``/healthz`` meanwhile.

The bombs are built cheaply: gzip members concatenate (one compressed MiB of ``a`` repeated is a GiB of name in a
MiB of archive) and so do raw deflate blocks flushed from a fresh compressor (a GiB of zeros in a MiB of zip).
"""

from __future__ import annotations

import gzip
import io
import os
import struct
import tarfile
import threading
import time
import tracemalloc
import zipfile
import zlib
from pathlib import Path

import httpx
import pytest
from fixtures.server import process_memory

from opentinker.infra.files import LinkRefusedError, open_dir_nofollow
from opentinker.server.packaging import Limits, UploadError, UploadFolderError, unpack

MiB = 1 << 20
GiB = 1 << 30


# ---------------------------------------------------------------- archive builders


def _pad(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % tarfile.BLOCKSIZE)


def _header(name: str, size: int = 0, kind: bytes = tarfile.REGTYPE, fmt: int = tarfile.USTAR_FORMAT) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    return info.tobuf(format=fmt)


def _gz(*pieces: bytes | tuple[bytes, int]) -> bytes:
    """A gzip of ``pieces`` in order; ``(chunk, n)`` is ``chunk`` n times, compressed once and repeated."""
    out = []
    for piece in pieces:
        chunk, times = piece if isinstance(piece, tuple) else (piece, 1)
        if chunk and times:
            out.append(gzip.compress(chunk, compresslevel=9 if times > 1 else 1) * times)
    return b"".join(out)


def _repeated(byte: bytes, size: int) -> list[bytes | tuple[bytes, int]]:
    whole, rest = divmod(size, MiB)
    return [(byte * MiB, whole), byte * rest]


END = b"\0" * (2 * tarfile.BLOCKSIZE)


def pax_long_name(size: int) -> bytes:
    """A .tar.gz whose one member's name, in its PAX header, is ``size`` bytes of ``a``."""
    rest = len(" path=") + size + 1
    length = rest + len(str(rest))
    length = rest + len(str(length))  # the record's length counts its own digits
    prefix = f"{length} path=".encode()
    header = _header("././@PaxHeader", length, tarfile.XHDTYPE)
    padding = b"\0" * (-length % tarfile.BLOCKSIZE)
    return _gz(header + prefix, *_repeated(b"a", size), b"\n" + padding + _header("pkg/x.py") + END)


def gnu_long_name(size: int) -> bytes:
    """A .tar.gz whose one member's name, in a GNU long-name header, is ``size`` bytes of ``b``."""
    header = _header("././@LongLink", size + 1, tarfile.GNUTYPE_LONGNAME, tarfile.GNU_FORMAT)
    padding = b"\0" * (-(size + 1) % tarfile.BLOCKSIZE)
    return _gz(header, *_repeated(b"b", size), b"\0" + padding + _header("pkg/x.py", fmt=tarfile.GNU_FORMAT) + END)


def tar(*members: tuple[str, bytes | None]) -> bytes:
    """A .tar.gz of ``(name, data)`` members in this order (``data`` None: a folder), duplicates allowed."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.PAX_FORMAT) as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                archive.addfile(info)
            else:
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def zip_archive(*members: tuple[str, bytes], compression: int = zipfile.ZIP_DEFLATED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression) as archive:
        for name, data in members:
            archive.writestr(name, data)
    return buffer.getvalue()


def zip_bomb(actual: int, declared: int, name: str = "pkg/zeros.bin") -> bytes:
    """A zip of one deflated member of ``actual`` zero bytes (and their CRC) whose local header and central directory
    both declare ``declared`` bytes."""
    block = zlib.compressobj(9, zlib.DEFLATED, -15)
    one = block.compress(b"\0" * MiB) + block.flush(zlib.Z_SYNC_FLUSH)  # no history before it: repeatable
    whole, rest = divmod(actual, MiB)
    tail = zlib.compressobj(1, zlib.DEFLATED, -15)
    stream = one * whole + tail.compress(b"\0" * rest) + tail.flush()
    crc = zlib.crc32(b"\0" * rest)
    for _ in range(whole):
        crc = zlib.crc32(b"\0" * MiB, crc)
    encoded = name.encode()
    local = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 8, 0, 0, crc, len(stream), declared, len(encoded), 0)
    central = struct.pack(
        "<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 8, 0, 0, crc, len(stream), declared, len(encoded), 0, 0, 0, 0, 0, 0
    )
    body = local + encoded + stream
    directory = central + encoded
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 1, 1, len(directory), len(body), 0)
    return body + directory + end


# ---------------------------------------------------------------- unit tests of unpack


@pytest.fixture
def uploads(tmp_path) -> Path:
    """A tenant's uploads folder (made by unpack when missing) under the server's data dir (which exists)."""
    (tmp_path / "data").mkdir()
    return tmp_path / "data" / "tenants" / "alice" / "uploads"


def _refused(data: bytes, filename: str, uploads: Path, limits: Limits | None = None) -> str:
    """Unpack must refuse: the one-line, bounded message; nothing is left in the uploads folder."""
    root = uploads.parents[2]
    with pytest.raises(UploadError) as refused:
        unpack(data, filename, uploads / "upl-test", root=root, limits=limits)
    message = str(refused.value)
    assert "\n" not in message and len(message) < 400, message
    assert not uploads.exists() or list(uploads.iterdir()) == [], list(uploads.iterdir())
    return message


def test_a_package_and_a_wheel_unpack_whole_into_place(uploads):
    root = uploads.parents[2]
    packages = unpack(
        tar(("mine", None), ("mine/__init__.py", b""), ("mine/envs.py", b"X = 1\n")),
        "mine.tar.gz",
        uploads / "a",
        root=root,
    )
    assert packages == ["mine"] and (uploads / "a" / "mine" / "envs.py").read_text() == "X = 1\n"
    wheel = zip_archive(("theirs/__init__.py", b""), ("theirs-1.0.dist-info/METADATA", b"x"), ("single.py", b""))
    assert unpack(wheel, "theirs-1.0-py3-none-any.whl", uploads / "b", root=root) == ["single", "theirs"]
    assert sorted(os.listdir(uploads)) == ["a", "b"]  # no .partial- folder left


def test_a_long_name_in_a_pax_header_is_cut_off_before_it_is_read(uploads):
    bomb = pax_long_name(GiB)
    assert len(bomb) < 2 * MiB
    tracemalloc.start()
    started = time.monotonic()
    try:
        message = _refused(bomb, "pkg.tar.gz", uploads)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 2.0
    assert peak < 8 * MiB, f"{peak / MiB:.1f} MiB allocated for a refused name"
    assert f"'{'a' * 100}'... ({GiB} bytes)" in message and "PAX header" in message and "65536" in message


def test_a_name_over_the_limit_in_a_small_pax_header_is_refused(uploads):
    message = _refused(tar(("pkg/" + "n" * 200 + "/" + "m" * 900 + ".py", b"x")), "pkg.tar.gz", uploads)
    assert "name longer than 1024 bytes" in message and "(1108 bytes)" in message
    message = _refused(tar(("pkg/" + "p" * 300 + ".py", b"x")), "pkg.tar.gz", uploads)
    assert "longer than 255 bytes" in message and "(307 bytes)" in message


def test_a_gnu_long_name_is_cut_off_before_it_is_read(uploads):
    message = _refused(gnu_long_name(64 * MiB), "pkg.tgz", uploads)
    assert f"'{'b' * 100}'... ({64 * MiB} bytes)" in message and "GNU long-name" in message and "1024" in message


def test_a_deep_path_is_refused(uploads):
    message = _refused(tar(("pkg/" + "d/" * 40 + "x.py", b"")), "pkg.tar.gz", uploads)
    assert "42 levels deep" in message and "at most 32" in message and "'pkg/d/d/" in message


def test_too_many_members_are_refused(uploads):
    members = [(f"pkg/m{i}.py", b"") for i in range(60)]
    message = _refused(tar(*members), "pkg.tar.gz", uploads, Limits(members=50))
    assert "'pkg/m50.py' is one too many" in message and "at most 50 members" in message
    message = _refused(zip_archive(*members), "pkg.zip", uploads, Limits(members=50))
    assert "60 members" in message and "at most 50 members" in message


def test_a_gzip_expansion_bomb_is_refused_by_the_bytes_it_unpacks(uploads):
    limits = Limits(total_bytes=8 * MiB, member_bytes=4 * MiB)
    one_big = _gz(_header("pkg/big.bin", GiB), *_repeated(b"\0", GiB), END)  # refused from its header
    message = _refused(one_big, "pkg.tar.gz", uploads, limits)
    assert "'pkg/big.bin' unpacks to more than 4194304 bytes" in message and "per member" in message
    many = b"".join(_header(f"pkg/{i}.bin", 3 * MiB) + b"\0" * 3 * MiB for i in range(4))
    message = _refused(gzip.compress(many + END, compresslevel=1), "pkg.tar.gz", uploads, limits)
    assert "'pkg/2.bin' takes the archive past 8388608 bytes" in message
    # headers alone count too: many small PAX headers expand the stream without one big member
    pax = [("pkg/" + "h" * 100 + f"{i}.py", b"") for i in range(2000)]
    message = _refused(tar(*pax), "pkg.tar.gz", uploads, Limits(total_bytes=MiB))
    assert "unpacks to more than 1048576 bytes after member 'pkg/hhh" in message


def test_a_zip_bomb_with_lying_sizes_is_refused(uploads):
    started = time.monotonic()
    message = _refused(zip_bomb(actual=GiB, declared=1000), "pkg.zip", uploads)  # read up to 1000 B: a bad CRC
    assert "'pkg/zeros.bin' cannot be read, corrupt or truncated" in message and "CRC" in message
    honest = zip_bomb(actual=64 * MiB, declared=64 * MiB)
    message = _refused(honest, "pkg.zip", uploads, Limits(total_bytes=8 * MiB, member_bytes=8 * MiB))
    assert "'pkg/zeros.bin' unpacks to more than 8388608 bytes" in message
    within = zip_bomb(actual=GiB, declared=4 * MiB)  # declares what the limits allow, holds a GiB
    message = _refused(within, "pkg.zip", uploads, Limits(total_bytes=8 * MiB, member_bytes=8 * MiB))
    assert "'pkg/zeros.bin' cannot be read, corrupt or truncated" in message
    assert time.monotonic() - started < 8.0


def test_a_zip_member_with_a_bad_crc_or_a_truncated_zip_is_refused(uploads):
    good = zip_archive(("pkg/__init__.py", b""), ("pkg/envs.py", b"hello world " * 10), compression=zipfile.ZIP_STORED)
    message = _refused(good.replace(b"hello world", b"hellO world", 1), "pkg.zip", uploads)
    assert "'pkg/envs.py' cannot be read, corrupt or truncated" in message and "CRC" in message
    message = _refused(good[: len(good) // 2], "pkg.zip", uploads)
    assert "not a readable archive" in message
    message = _refused(tar(("pkg/a.py", b"x" * 5000))[:-40], "pkg.tar.gz", uploads)
    assert "not a readable archive" in message


def test_a_sparse_file_or_a_device_is_refused(uploads):
    sparse = _gz(_header("pkg/holes.bin", GiB, tarfile.GNUTYPE_SPARSE, tarfile.GNU_FORMAT) + END)
    assert "'pkg/holes.bin' is a sparse file" in _refused(sparse, "pkg.tar.gz", uploads)
    device = _gz(_header("pkg/tty", 0, tarfile.CHRTYPE) + END)
    assert "'pkg/tty' is not a regular file or folder" in _refused(device, "pkg.tar.gz", uploads)


@pytest.mark.parametrize(
    ("members", "expected"),
    [
        ([("pkg/a", b"file"), ("pkg/a/b.py", b"")], "'pkg/a/b.py' is inside 'pkg/a', an earlier member that is a file"),
        ([("pkg/a", None), ("pkg/a", b"file")], "'pkg/a' is a file, but an earlier member made it a folder"),
        ([("pkg/a/b.py", b""), ("pkg/a", b"file")], "'pkg/a' is a file, but an earlier member made it a folder"),
        ([("pkg/a.py", b"1"), ("pkg/a.py", b"2")], "'pkg/a.py' appears twice"),
        ([("pkg/a.py", b"1"), ("./pkg//a.py", b"2")], "'./pkg//a.py' appears twice"),
    ],
    ids=["file then folder", "folder then file", "file inside then file", "duplicate", "duplicate spelled apart"],
)
@pytest.mark.filterwarnings("ignore:Duplicate name")  # zipfile warns as it writes the duplicate
def test_a_file_and_a_folder_of_the_same_name_or_a_duplicate_are_refused(uploads, members, expected):
    assert expected in _refused(tar(*members), "pkg.tar.gz", uploads)
    files = [(name if data is not None else name + "/", data or b"") for name, data in members]
    assert expected.split(" ", 1)[0] in _refused(zip_archive(*files), "pkg.zip", uploads)


def test_an_uploads_folder_replaced_by_a_link_is_not_followed(tmp_path, uploads):
    other = tmp_path / "data" / "tenants" / "bob"
    other.mkdir(parents=True)
    uploads.parent.mkdir(parents=True)
    uploads.symlink_to(other, target_is_directory=True)  # as a job of alice's could
    archive = tar(("pkg/__init__.py", b""))
    with pytest.raises(UploadFolderError) as refused:
        unpack(archive, "pkg.tar.gz", uploads / "upl-x", root=tmp_path / "data")
    assert refused.value.status == 409 and "'tenants/alice/uploads' is a symbolic link" in str(refused.value)
    assert list(other.iterdir()) == []
    uploads.unlink()  # a folder above it
    uploads.parent.rename(tmp_path / "alice-real")
    uploads.parent.symlink_to(other, target_is_directory=True)
    with pytest.raises(UploadFolderError, match="'tenants/alice' is a symbolic link"):
        unpack(archive, "pkg.tar.gz", uploads / "upl-x", root=tmp_path / "data")
    assert list(other.iterdir()) == []


def test_open_dir_nofollow_refuses_links_and_makes_missing_folders(tmp_path):
    fd = open_dir_nofollow(tmp_path, "a/b/c", create=True)
    try:
        os.mkdir("d", dir_fd=fd)
    finally:
        os.close(fd)
    assert (tmp_path / "a" / "b" / "c" / "d").is_dir()
    (tmp_path / "a" / "link").symlink_to(tmp_path / "a" / "b")
    (tmp_path / "a" / "file").write_text("")
    for relative, what in (("a/link/c", "symbolic link"), ("a/link", "symbolic link"), ("a/file", "not a folder")):
        with pytest.raises(LinkRefusedError, match=what):
            open_dir_nofollow(tmp_path, relative)
    with pytest.raises(FileNotFoundError):
        open_dir_nofollow(tmp_path, "a/missing")
    with pytest.raises(ValueError):
        open_dir_nofollow(tmp_path, "a/../..")


# ---------------------------------------------------------------- the server over HTTP


@pytest.mark.slow
def test_the_server_answers_bombs_with_422_and_stays_responsive(api_server):
    server = api_server
    key = server.make_key("bomber")
    pid = server.service.pid
    measured = Path(f"/proc/{pid}/status").exists()
    if measured:
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets the peak (VmHWM) to the RSS now
        except OSError:
            pass
        before = process_memory(pid)["VmRSS"]
    log_size = server.log.stat().st_size
    bombs = [
        ("pkg.tar.gz", pax_long_name(GiB), f"({GiB} bytes)"),
        ("pkg.tgz", gnu_long_name(GiB), f"({GiB} bytes)"),
        ("pkg.zip", zip_bomb(actual=GiB, declared=1000), "'pkg/zeros.bin'"),
        ("pkg.zip", zip_bomb(actual=GiB, declared=GiB), "'pkg/zeros.bin' unpacks to more than"),
    ]
    latencies, done = [], threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=10) as client:
            while not done.is_set():
                started = time.monotonic()
                try:
                    ok = client.get(f"{server.url}/healthz").status_code == 200
                except httpx.HTTPError:
                    ok = False
                latencies.append(time.monotonic() - started if ok else float("inf"))
                time.sleep(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    answers = []
    try:
        with httpx.Client(timeout=60, headers=server.headers(key)) as client:
            for filename, body, _ in bombs:
                assert len(body) < 2 * MiB  # under the test server's body limit: the limits inside hold
                started = time.monotonic()
                answer = client.post(f"{server.url}/v1/uploads", params={"filename": filename}, content=body)
                answers.append((answer, time.monotonic() - started))
    finally:
        done.set()
        poller.join(timeout=15)
    for (answer, seconds), (_, _, expected) in zip(answers, bombs, strict=True):
        assert answer.status_code == 422, answer.text[:500]
        detail = answer.json()["detail"]
        assert expected in detail and "\n" not in detail and len(detail) < 400, detail
        assert seconds < 5, f"{seconds:.1f} s to refuse {detail}"
    assert latencies and max(latencies) < 1.0, f"/healthz took up to {max(latencies):.2f} s"
    uploads = server.data_dir / "tenants" / "bomber" / "uploads"
    assert not uploads.exists() or list(uploads.iterdir()) == []
    assert server.log.stat().st_size - log_size < 64 * 1024  # bounded lines, no attacker-sized traceback
    if measured:
        grown = max(process_memory(pid).values()) - before
        assert grown < 200 * MiB, f"the server grew by {grown / MiB:.0f} MiB"
    answer = httpx.post(
        f"{server.url}/v1/uploads",
        params={"filename": "pkg.tar.gz"},
        content=tar(("pkg/__init__.py", b"")),
        headers=server.headers(key),
        timeout=30,
    )
    assert answer.status_code == 201 and answer.json()["packages"] == ["pkg"], answer.text
