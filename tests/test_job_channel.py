"""The attempt's channel as a hostile child would use it: every malformed, oversized or misplaced message fails the
attempt with one line naming what was wrong, before trusted code allocates or writes anything for it."""

from __future__ import annotations

import hashlib
import json
import socket
import threading

import pytest

from opentinker.server.channel import (
    HEADER,
    Channel,
    ChannelError,
    FileBegin,
    Metrics,
    PolicyResult,
    Start,
)

MAX_FILE, MAX_TOTAL = 1 << 16, 1 << 17


def _pair() -> tuple[Channel, Channel]:
    ours, theirs = socket.socketpair()
    return Channel(ours), Channel(theirs)


def _read_all(channel: Channel) -> list:
    """Every message; a file as ``(FileBegin, its bytes)``."""
    return [
        (message[0], b"".join(message[1])) if isinstance(message, tuple) else message
        for message in channel.messages(MAX_FILE, MAX_TOTAL)
    ]


def _raw(channel: Channel, kind: str, payload: bytes) -> None:
    channel.sock.sendall(HEADER.pack(len(payload), ord(kind)) + payload)


def _from_child(write) -> list:
    """What the trusted side reads while a child thread runs ``write(channel)`` then closes its end."""
    trusted, child = _pair()

    def run() -> None:
        try:
            write(child)
        except OSError:
            pass
        finally:
            child.close()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        return _read_all(trusted)
    finally:
        trusted.close()
        thread.join(timeout=10)


def test_a_well_behaved_child_is_read_whole(tmp_path):
    evaluation = {"returns": [1.0, 3.0], "seed": 7}
    weights = tmp_path / "weights.npz"
    weights.write_bytes(b"\x00" * 5000)

    def child(channel: Channel) -> None:
        channel.send(Metrics(step=64, values={"charts/sps": 1000.0, "losses/value": float("nan")}))
        channel.send_file("export/weights.npz", weights)
        channel.send(
            PolicyResult(start_step=0, global_step=64, train_seconds=1.5, evaluation=evaluation, threshold=None)
        )

    metrics, (begin, data), result = _from_child(child)
    assert metrics.step == 64 and metrics.values["charts/sps"] == 1000.0 and metrics.values["losses/value"] != 0
    assert begin.path == "export/weights.npz" and data == b"\x00" * 5000
    assert result.evaluation.returns == [1.0, 3.0]


def test_the_start_message_reaches_the_child():
    trusted, child = _pair()
    trusted.send(Start(spec={"env_id": "CartPole-v1"}))
    assert child.receive_start().spec == {"env_id": "CartPole-v1"}


def _json(channel: Channel, body: dict) -> None:
    _raw(channel, "J", json.dumps(body).encode())


def _file(channel: Channel, path: str, size: int = 1) -> None:
    _json(channel, {"type": "file", "path": path, "size": size, "sha256": "0" * 64})


def _policy_result(evaluation: dict) -> dict:
    return {
        "type": "policy",
        **{"start_step": 0, "global_step": 8, "train_seconds": 1.0},
        "evaluation": {"returns": [1.0, 2.0], "seed": 0, **evaluation},
    }


ATTACKS = {
    "not json": (lambda c: _raw(c, "J", b"{not json"), "invalid message"),
    "unknown type": (lambda c: _json(c, {"type": "admin", "cmd": "rm"}), "invalid message"),
    "extra field": (lambda c: _json(c, {"type": "log", "line": "x", "token": "t"}), "token"),
    "too many metrics": (
        lambda c: _json(c, {"type": "metrics", "step": 1, "values": {f"k{i}": 1.0 for i in range(300)}}),
        "values",
    ),
    "huge log line": (lambda c: _json(c, {"type": "log", "line": "x" * 100_000}), "line"),
    "a served action not known": (lambda c: _json(c, _policy_result({"action": "argmax"})), "action"),
    "other episodes for the other action": (
        lambda c: _json(c, _policy_result({"alternative_returns": [1.0]})),
        "alternative_returns",
    ),
    "path with ..": (
        lambda c: _json(c, {"type": "file", "path": "export/../../other/x", "size": 1, "sha256": "0" * 64}),
        "path",
    ),
    "absolute path": (
        lambda c: _json(c, {"type": "file", "path": "/etc/passwd", "size": 1, "sha256": "0" * 64}),
        "path",
    ),
    "file over its limit": (
        lambda c: _json(c, {"type": "file", "path": "export/weights.npz", "size": MAX_FILE + 1, "sha256": "0" * 64}),
        "at most",
    ),
    "a file its format does not name": (lambda c: _file(c, "export/extra.bin"), "file export/extra.bin: not a file"),
    "a group export's folder as a file": (lambda c: _file(c, "exports/hunter/."), "file exports/hunter/.: not a file"),
    "an adapter's folder as a file": (lambda c: _file(c, "adapter/."), "file adapter/.: not a file"),
    "an adapter's parent": (lambda c: _file(c, "adapter/.."), "file adapter/..: not a file"),
    "a checkpoint of another name": (lambda c: _file(c, "checkpoints/other.pt"), "checkpoints/other.pt: not a file"),
    "a tokenizer file over its limit": (lambda c: _file(c, "adapter/tokenizer.json", 1 << 30), "at most 67108864"),
    "a config file over its limit": (lambda c: _file(c, "adapter/tokenizer_config.json", 2 << 20), "at most 1048576"),
    "a file path the pattern refuses": (lambda c: _file(c, "export/a b"), "(got 'export/a b')"),
    "bytes without a file": (lambda c: _raw(c, "B", b"\x00" * 10), "without a file message"),
    "oversized frame": (lambda c: c.sock.sendall(HEADER.pack(1 << 31, ord("J"))), "at most"),
    "unknown frame kind": (lambda c: c.sock.sendall(HEADER.pack(3, ord("X")) + b"abc"), "expected J or B"),
    "wrong checksum": (
        lambda c: (
            c.send(FileBegin(path="export/policy.json", size=3, sha256=hashlib.sha256(b"xyz").hexdigest())),
            _raw(c, "B", b"abc"),
        ),
        "checksum",
    ),
    "more bytes than announced": (
        lambda c: (
            c.send(FileBegin(path="export/policy.json", size=2, sha256=hashlib.sha256(b"ab").hexdigest())),
            _raw(c, "B", b"abc"),
        ),
        "did not follow as announced",
    ),
}


@pytest.mark.parametrize("case", list(ATTACKS))
def test_a_hostile_message_fails_the_attempt_naming_what_was_wrong(case):
    write, expected = ATTACKS[case]
    with pytest.raises(ChannelError) as refused:
        _from_child(write)
    assert expected in str(refused.value) and len(str(refused.value)) < 400


def test_files_of_one_attempt_are_bounded_together(tmp_path):
    checkpoint = tmp_path / "c.pt"
    checkpoint.write_bytes(b"\x01" * (48 << 10))

    def child(channel: Channel) -> None:
        for _ in range(3):  # 3 x 48 KiB > the 128 KiB per attempt (a checkpoint is sent again as it is rewritten)
            channel.send_file("checkpoints/checkpoint.pt", checkpoint)

    with pytest.raises(ChannelError, match="per attempt"):
        _from_child(child)


# ---------------------------------------------------------------- a hostile child through the attempt's own pump

CHILD_PRELUDE = """
import hashlib, os
from opentinker.server.channel import HEADER, Channel, Failure, FileBegin, Log
channel = Channel.from_fd(int(os.environ["OPENTINKER_CHANNEL_FD"]))
"""


@pytest.fixture
def hostile_child(tmp_path, monkeypatch):
    """``run(code)``: ``code`` as the attempt's child (unsandboxed, no cgroup: the channel is the subject), pumped by
    ``SandboxedChild`` into ``tmp_path/job``; (what ``pump`` returned or raised, the lines the attempt logged)."""
    import logging

    from opentinker.infra.settings import get_settings
    from opentinker.server.sandboxed import SandboxedChild
    from opentinker.server.schemas import LaunchInfo
    from opentinker.tasks.spec import RunSpec

    monkeypatch.setenv("OPENTINKER_SANDBOX", "none")
    monkeypatch.setenv("OPENTINKER_JOB_LIMITS", "none")
    get_settings.cache_clear()
    launch = LaunchInfo(
        job_id="job-hostile",
        tenant="mallory",
        token="t",
        spec=RunSpec(env_id="CartPole-v1"),
        job_dir=str(tmp_path / "job"),
        tracking_uri="",
        experiment="e",
        readonly=[],
        env={},
        limits={},
        isolated=True,
    )
    logger = logging.getLogger(f"test.hostile.{tmp_path.name}")
    logger.propagate = False
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)

    def run(code: str):
        child = SandboxedChild(launch, tmp_path / "job", None, logger, command=("-c", CHILD_PRELUDE + code))
        try:
            return child.pump(tmp_path / "job", lambda *_: None), lines
        except Exception as exc:
            return exc, lines
        finally:
            child.close()

    yield run
    get_settings.cache_clear()


def test_a_childs_escape_sequences_reach_the_log_escaped(hostile_child):
    outcome, lines = hostile_child(
        'channel.send(Log(line="\\x1b]0;pwned\\x07\\x1b[2Jcleared\\rover\\tkept"))\n'
        'print("\\x1b[31mred\\x1b[0m\\x9b1m", flush=True)\n'
        'channel.send(Failure(error="Traceback\\n\\x1b[2Jboom"))\n'
    )
    assert not any(c in line for line in lines for c in "\x1b\r\x07\x9b"), lines
    assert "job: \\x1b]0;pwned\\x07\\x1b[2Jcleared\\x0dover\tkept" in lines
    assert "job: \\x1b[31mred\\x1b[0m\\x9b1m" in lines
    assert "\x1b" not in str(outcome) and "Traceback\n\\x1b[2Jboom" in str(outcome)


def test_a_channel_closed_inside_a_file_names_the_file_and_the_bytes(hostile_child):
    outcome, _ = hostile_child(
        'channel.send(FileBegin(path="export/weights.npz", size=1000, sha256="0" * 64))\n'
        'channel.sock.sendall(HEADER.pack(300, ord("B")) + bytes(300))\n'
        "os._exit(0)\n"
    )
    assert "file export/weights.npz: the job's channel closed after 300 of 1000 bytes" in str(outcome), outcome


def test_a_file_the_run_folder_cannot_store_fails_the_attempt_naming_the_cause(hostile_child, tmp_path):
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "export").write_text("in the way")  # a storage fault: the folder cannot be made
    outcome, _ = hostile_child(
        'path = "/tmp/policy-%d.json" % os.getpid()\n'
        'open(path, "w").write("{}")\n'
        'channel.send_file("export/policy.json", __import__("pathlib").Path(path))\n'
        "os.unlink(path)\n"
    )
    message = str(outcome)
    assert "file export/policy.json: could not be stored in the job's run folder" in message, message
    assert "exited with" not in message


# ---------------------------------------------------------------- a job's export, loaded by trusted code

MiB, GiB = 1 << 20, 1 << 30


def _npy_header(shape: tuple[int, ...], dtype: str = "<f4") -> bytes:
    import io

    import numpy as np

    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


def _zip(members: list[tuple[str, bytes, int, int]]) -> bytes:
    """A zip of ``(name, stored bytes, their CRC, size declared)`` members: the bytes are written as they are (raw
    deflate when ``size declared`` differs from their length), so a bomb costs what it compresses to."""
    import struct

    body, directory = b"", b""
    for name, data, crc, size in members:
        method = 0 if size == len(data) else 8
        encoded = name.encode()
        local = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, method, 0, 0, crc, len(data), size, len(encoded), 0)
        directory += (
            struct.pack(
                "<4s6H3L5H2L",
                b"PK\x01\x02",
                20,
                20,
                0,
                method,
                0,
                0,
                crc,
                len(data),
                size,
                len(encoded),
                0,
                0,
                0,
                0,
                0,
                len(body),
            )
            + encoded
        )
        body += local + encoded + data
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members), len(members), len(directory), len(body), 0)
    return body + directory + end


def _deflated_zeros(header: bytes, zeros: int) -> tuple[bytes, int]:
    """``header`` then ``zeros`` zero bytes as raw deflate (one compressed MiB of zeros repeated) and their CRC."""
    import zlib

    first = zlib.compressobj(9, zlib.DEFLATED, -15)
    start = first.compress(header) + first.flush(zlib.Z_FULL_FLUSH)
    block = zlib.compressobj(9, zlib.DEFLATED, -15)
    one = block.compress(b"\0" * MiB) + block.flush(zlib.Z_FULL_FLUSH)
    crc = zlib.crc32(header)
    for _ in range(zeros // MiB):
        crc = zlib.crc32(b"\0" * MiB, crc)
    return start + one * (zeros // MiB) + zlib.compressobj(9, zlib.DEFLATED, -15).flush(), crc


def _stored(name: str, header: bytes, data: bytes) -> tuple[str, bytes, int, int]:
    import zlib

    return name, header + data, zlib.crc32(header + data), len(header + data)


def _peak_rss_growth(call) -> int:
    """Bytes this process's peak RSS grew by while ``call()`` ran (the kernel's high-water mark, reset first)."""

    def status(field: str) -> int:
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise AssertionError(field)

    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # VmHWM := VmRSS
    before = status("VmRSS")
    call()
    return status("VmHWM") - before


WEIGHTS_ATTACKS = {
    "a GiB declared in 4 MiB": (
        lambda: [_stored("pi.npy", _npy_header((GiB // 4,)), bytes(4 * MiB))],
        f"member 'pi.npy' declares {GiB} bytes (268435456,) float32, taking the arrays past {512 * MiB} bytes",
    ),
    "a GiB of zeros deflated into a MiB": (
        lambda: [("pi.npy", *_deflated_zeros(header := _npy_header((GiB // 4,)), GiB), GiB + len(header))],
        f"member 'pi.npy' declares {GiB} bytes",
    ),
    "within the limit declared, a MiB held": (
        lambda: [_stored("pi.npy", _npy_header((64 * MiB,)), bytes(MiB))],
        f"member 'pi.npy' declares {256 * MiB} bytes of data but holds {MiB}",
    ),
    "many members adding up": (
        lambda: (
            [_stored(f"w{i}.npy", _npy_header((MiB // 4,)), bytes(MiB)) for i in range(3)]
            + [_stored("big.npy", _npy_header((128 * MiB - 1,)), b"")]
        ),
        "member 'big.npy' declares 536870908 bytes",
    ),
    "bytes that do not match their CRC": (
        lambda: [("pi.npy", (data := _npy_header((4,)) + bytes(16)), 12345, len(data))],
        "not a readable archive of arrays (Bad CRC-32 for file 'pi.npy')",
    ),
    "pickled objects": (lambda: [_stored("o.npy", _npy_header((1,), "|O"), bytes(8))], "'o.npy' holds Python objects"),
    "not an array": (lambda: [_stored("run.py", b"", b"import os")], "'run.py' is not an array"),
}


@pytest.mark.parametrize("case", list(WEIGHTS_ATTACKS))
def test_weights_declaring_more_than_they_may_are_refused_before_they_are_allocated(tmp_path, case):
    """The attempt's check of a job's export (``finish._validated_export``, through the one loader of exports): peak
    RSS grows by less than 32 MiB whatever the file declares."""
    from opentinker.server.finish import _validated_export

    members, expected = WEIGHTS_ATTACKS[case]
    export = tmp_path / "job" / "export"
    export.mkdir(parents=True)
    (export / "policy.json").write_text('{"format_version": 2}')
    (export / "weights.npz").write_bytes(_zip(members()))
    assert (export / "weights.npz").stat().st_size < 8 * MiB
    refused = []

    def load() -> None:
        with pytest.raises(ChannelError) as error:
            _validated_export(export, "run-1")
        refused.append(str(error.value))

    grown = _peak_rss_growth(load)
    assert refused[0].startswith("export: weights.npz: ") and expected in refused[0], refused[0]
    assert grown < 32 * MiB, f"peak RSS grew by {grown / MiB:.0f} MiB"


def test_a_zip_directory_larger_than_an_export_needs_is_refused_unread(tmp_path):
    import struct

    from opentinker.agents.export import WeightsError, read_weights

    path = tmp_path / "weights.npz"
    path.write_bytes(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 1, 1, 3 * GiB, 0, 0))
    with pytest.raises(WeightsError, match="at most 1024 arrays"):
        read_weights(path)


def test_an_adapter_whose_safetensors_header_declares_a_gib_is_refused_unread(tmp_path):
    from opentinker.server.finish import _validated_adapter

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(GiB.to_bytes(8, "little") + b"{")
    with pytest.raises(ChannelError, match=f"adapter/adapter_model.safetensors: a header of {GiB} bytes declared"):
        _validated_adapter(adapter)
