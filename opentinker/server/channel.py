"""The one way out of a job's sandbox: a private, typed, versioned, size-bounded channel per attempt.

The trusted attempt process (``attempt.py``) makes a ``socketpair`` and passes one end to the sandboxed child as an
inherited descriptor: no path, port or token names it, so no other job can open it and nothing shared is writable.
Frames are ``[4-byte length][1-byte kind][payload]``: kind ``J`` a JSON message (at most ``MAX_MESSAGE`` bytes), kind
``B`` a chunk of the file the last ``FileBegin`` announced (streamed to disk by the reader, never held whole). The
reader validates every message with the pydantic models below (unknown fields, wrong types, oversized strings and maps
are refused: the attempt fails with one line naming the field), bounds each file and all files of an attempt, and
throttles a chatty child by reading no more than ``MAX_MESSAGES_PER_S`` (back-pressure: the child's writes block).
Nothing a job writes reaches trusted code otherwise.
"""

from __future__ import annotations

import hashlib
import re
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

VERSION = 1
MAX_MESSAGE = 1 << 20
"""A JSON message's bytes."""
CHUNK = 1 << 20
"""A file chunk's bytes."""
MAX_MESSAGES_PER_S = 200
MAX_METRICS = 256
MAX_LINE = 2000
FILE_PATTERN = r"^(checkpoints|export|adapter|exports/[a-z0-9_-]{1,64})/[A-Za-z0-9_.-]{1,128}$"
"""Where a job's files may land under its run folder: checkpoints, a policy export, an adapter, a group's exports."""
POLICY_FILES = frozenset(("policy.json", "weights.npz"))
"""A numpy policy export (``agents.export.export_policy``), under ``export/`` and each ``exports/<kind>/``."""
ADAPTER_FILES = frozenset(
    (
        "adapter_model.safetensors",
        "adapter_config.json",
        "opentinker_llm.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
    )
)
"""A GRPO adapter (``MultiLoraModel.save``: peft's, the tokenizer's, ``opentinker_llm.json``), under ``adapter/``."""
FOLDER_FILES = {"checkpoints": frozenset(("checkpoint.pt",)), "export": POLICY_FILES, "adapter": ADAPTER_FILES}
"""The only file names each folder may hold (``exports/<kind>`` as ``export``): a job sends its format's files, and
nothing else reaches the run folder, MLflow or a download."""
TOKENIZER_DATA = frozenset(("tokenizer.json", "vocab.json", "merges.txt"))
"""An adapter's tokenizer data: read by the tokenizers library in a sandbox or a serving process, never parsed by the
attempt (a few MB for SmolLM2's)."""
MAX_TOKENIZER_FILE = 64 << 20
MAX_TEXT_FILE = 1 << 20
"""Bytes of any other JSON or text file (``policy.json``, configs): trusted code parses them whole, and parsed JSON
takes up to ~20 times its size. The weights (``.npz``, ``.pt``, ``.safetensors``) are bounded by the attempt's file
limits and read by bounded loaders."""
HEADER = struct.Struct(">IB")

Name = Annotated[str, Field(max_length=128)]
Line = Annotated[str, Field(max_length=MAX_LINE)]


class ChannelError(RuntimeError):
    """The child broke the protocol (a malformed, oversized or unexpected message): the attempt fails with this."""


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")


class Start(Message):
    """Trusted → child, first and only: what to run."""

    type: Literal["start"] = "start"
    version: int = VERSION
    spec: dict[str, Any]
    champion_dir: str | None = None
    """A read-only folder with the current champion's export (policy) or adapter (GRPO), to evaluate beside."""


class Metrics(Message):
    """One training iteration's metrics at global ``step`` (they go to the MLflow run and the job's progress)."""

    type: Literal["metrics"] = "metrics"
    step: int = Field(ge=0, le=1 << 62)
    values: dict[Name, float] = Field(max_length=MAX_METRICS)


class Log(Message):
    type: Literal["log"] = "log"
    level: Literal["info", "warning", "error"] = "info"
    line: Line


class FileBegin(Message):
    """The next ``size`` bytes of ``B`` frames are the file ``path`` under the job's run folder."""

    type: Literal["file"] = "file"
    path: str = Field(pattern=FILE_PATTERN)
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @model_validator(mode="after")
    def _a_file_of_its_format(self) -> FileBegin:
        folder, name = self.path.rsplit("/", 1)
        if name not in (allowed := folder_files(folder)):
            expected = ", ".join(sorted(allowed))
            raise ValueError(f"file {self.path}: not a file of {folder}/ (expected one of {expected})")
        if not name.endswith((".npz", ".pt", ".safetensors")):
            limit = MAX_TOKENIZER_FILE if name in TOKENIZER_DATA else MAX_TEXT_FILE
            if self.size > limit:
                raise ValueError(f"file {self.path}: {self.size} bytes; at most {limit} for this file")
        return self


def folder_files(folder: str) -> frozenset[str]:
    """The file names ``folder`` (``checkpoints``, ``export``, ``adapter``, ``exports/<kind>``) may hold."""
    return FOLDER_FILES["export" if folder.startswith("exports/") else folder]


class Evaluation(Message):
    """An evaluation's returns on seeds ``seed + i``; the mean and std are computed by the reader, not believed. The
    trusted side chooses what a candidate serves from both actions' returns (``evaluation.choose_served``)."""

    returns: list[float] = Field(min_length=1, max_length=100_000)
    seed: int
    action: Literal["greedy", "sampled"] = "greedy"
    """How the ``returns`` acted: the model's served action (a fresh export's is greedy)."""
    alternative_returns: list[float] | None = Field(None, min_length=1, max_length=100_000)
    """A stochastic policy's returns acting the other way, on the same seeds."""
    mean_length: float | None = None
    terminated_fraction: float | None = None

    @model_validator(mode="after")
    def _same_episodes(self) -> Evaluation:
        if self.alternative_returns is not None and len(self.alternative_returns) != len(self.returns):
            raise ValueError("alternative_returns: expected one return per episode of returns")
        return self


class PolicyResult(Message):
    """A policy job's end: how far it trained and what it scored (its export and checkpoint went as files)."""

    type: Literal["policy"] = "policy"
    start_step: int = Field(ge=0)
    global_step: int = Field(ge=0)
    train_seconds: float = Field(ge=0)
    evaluation: Evaluation
    champion_evaluation: Evaluation | None = None
    random_evaluation: Evaluation | None = None
    threshold: float | None = None


class GroupResult(Message):
    """A multi-agent group's end: one export and evaluation per agent kind (``exports/<kind>/``)."""

    type: Literal["group"] = "group"
    global_step: int = Field(ge=0)
    evaluations: dict[Annotated[str, Field(pattern=r"^[a-z0-9_-]{1,64}$")], Evaluation] = Field(max_length=64)


class LMEvaluation(Message):
    """Greedy episodes on the first ``prompts`` held-out examples (``tasks.llm.LLMEvaluation``'s fields)."""

    success: float = Field(ge=0, le=1)
    mean_reward: float
    valid_tool_call_rate: float = Field(ge=0, le=1)
    response_tokens: float = Field(ge=0)
    prompts: int = Field(ge=0)


class GRPOResult(Message):
    """A GRPO job's end: the adapter (``adapter/``) and its held-out evaluation, the champion's beside it."""

    type: Literal["grpo"] = "grpo"
    updates: int = Field(ge=0)
    train_seconds: float = Field(ge=0)
    completions_per_s: float = Field(ge=0)
    evaluation: LMEvaluation
    base_evaluation: LMEvaluation | None = None
    champion_success: float | None = Field(None, ge=0, le=1)


class Failure(Message):
    type: Literal["failure"] = "failure"
    error: Annotated[str, Field(max_length=8000)]


Result = PolicyResult | GroupResult | GRPOResult
FromChild = Annotated[
    Metrics | Log | FileBegin | PolicyResult | GroupResult | GRPOResult | Failure, Field(discriminator="type")
]
_from_child: TypeAdapter[Any] = TypeAdapter(FromChild)


class Channel:
    """One end of an attempt's socket pair, with framing and limits; the child's end is ``Channel(fd=N)``."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    @classmethod
    def from_fd(cls, fd: int) -> Channel:
        return cls(socket.socket(fileno=fd))

    def close(self) -> None:
        self.sock.close()

    # -- writing (either side) --

    def send(self, message: Message) -> None:
        payload = message.model_dump_json().encode()
        if len(payload) > MAX_MESSAGE:
            raise ChannelError(f"message {message.__class__.__name__}: {len(payload)} bytes, at most {MAX_MESSAGE}")
        self.sock.sendall(HEADER.pack(len(payload), ord("J")) + payload)

    def send_file(self, path: str, source: Path) -> None:
        """The file ``source`` as ``path`` under the job's run folder, streamed in chunks (two reads: the checksum
        goes first)."""
        digest, size = hashlib.sha256(), 0
        with source.open("rb") as handle:
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
                size += len(chunk)
            self.send(FileBegin(path=path, size=size, sha256=digest.hexdigest()))
            handle.seek(0)
            sent = 0
            while sent < size and (chunk := handle.read(min(CHUNK, size - sent))):
                self.sock.sendall(HEADER.pack(len(chunk), ord("B")) + chunk)
                sent += len(chunk)
        if sent != size:
            raise ChannelError(f"file {path}: changed while it was sent")

    # -- reading --

    def _exactly(self, n: int) -> bytes:
        buffer = bytearray()
        while len(buffer) < n:
            part = self.sock.recv(min(n - len(buffer), CHUNK))
            if not part:
                raise EOFError
            buffer += part
        return bytes(buffer)

    def _frame(self) -> tuple[str, bytes]:
        size, kind = HEADER.unpack(self._exactly(HEADER.size))
        if kind not in (ord("J"), ord("B")) or size > max(MAX_MESSAGE, CHUNK):
            raise ChannelError(f"frame: kind {kind} of {size} bytes; expected J or B of at most {MAX_MESSAGE}")
        return chr(kind), self._exactly(size)

    def receive_start(self) -> Start:
        """The child's first read: the start message."""
        kind, payload = self._frame()
        if kind != "J":
            raise ChannelError("expected the start message")
        return Start.model_validate_json(payload)

    def messages(self, max_file: int, max_total: int) -> Iterator[Message | tuple[FileBegin, Iterator[bytes]]]:
        """The child's messages until it closes its end. A file comes as ``(FileBegin, chunks)``: the caller must
        consume ``chunks`` before the next message (it streams the file's bytes, at most ``CHUNK`` each, so a large
        file never sits in trusted memory) and ends with ``ChannelError`` when the bytes or checksum are not as
        announced. ``max_file``/``max_total``: bytes of one file, of all files of the attempt."""
        total, window, count = 0, int(time.monotonic()), 0
        while True:
            try:
                kind, payload = self._frame()
            except EOFError:
                return
            now = int(time.monotonic())
            window, count = (window, count + 1) if now == window else (now, 1)
            if count > MAX_MESSAGES_PER_S:
                time.sleep(max(0.0, window + 1 - time.monotonic()))
            if kind != "J":
                raise ChannelError("file bytes without a file message before them")
            try:
                message = _from_child.validate_json(payload)
            except ValidationError as exc:
                raise ChannelError(f"invalid message from the job: {_first_error(exc)}") from None
            if not isinstance(message, FileBegin):
                yield message
                continue
            if message.size > max_file or total + message.size > max_total:
                raise ChannelError(
                    f"file {message.path}: {message.size} bytes; at most {max_file} per file, {max_total} per attempt"
                )
            total += message.size
            chunks = self._file(message)
            yield message, chunks
            for _ in chunks:  # whatever the caller left unread
                pass

    def _file(self, begin: FileBegin) -> Iterator[bytes]:
        received, digest = 0, hashlib.sha256()
        while received < begin.size:
            try:
                kind, chunk = self._frame()
            except EOFError:
                raise ChannelError(
                    f"file {begin.path}: the job's channel closed after {received} of {begin.size} bytes"
                ) from None
            except OSError as exc:  # here, not where the caller writes the file: its OSErrors are storage's
                raise ChannelError(
                    f"file {begin.path}: the job's channel failed after {received} of {begin.size} bytes ({exc})"
                ) from None
            if kind != "B" or received + len(chunk) > begin.size:
                raise ChannelError(f"file {begin.path}: its bytes did not follow as announced ({begin.size} bytes)")
            received += len(chunk)
            digest.update(chunk)
            yield chunk
        if digest.hexdigest() != begin.sha256:
            raise ChannelError(f"file {begin.path}: checksum does not match")


def evaluation_result(evaluation: Evaluation, model_key: str) -> Any:
    """The RL core's ``EvalResult`` of a reported evaluation (mean and std computed here), the other action's beside
    it when reported."""
    from opentinker.agents.evaluation import EvalResult

    alternative = None
    if evaluation.alternative_returns is not None:
        other = "sampled" if evaluation.action == "greedy" else "greedy"
        alternative = EvalResult.of(
            evaluation.alternative_returns, seed=evaluation.seed, model_key=model_key, action=other
        )
    return EvalResult.of(
        evaluation.returns,
        seed=evaluation.seed,
        model_key=model_key,
        mean_length=evaluation.mean_length,
        terminated_fraction=evaluation.terminated_fraction,
        action=evaluation.action,
        alternative=alternative,
    )


def safe_relative(path: str) -> PurePosixPath:
    """A validated file path as a relative path (the pattern already excludes ``..`` and absolute paths)."""
    relative = PurePosixPath(path)
    if relative.is_absolute() or ".." in relative.parts:
        raise ChannelError(f"file {path[:100]!r}: not a plain relative path")
    return relative


_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def escape_controls(text: str, keep: str = "\t") -> str:
    """``text`` with its control characters (ESC, CR, backspace, C1 codes; all but ``keep``) written as ``\\xNN``: a
    job's line shown in a terminal (``opentinker jobs logs``, the operator's) cannot move the cursor, recolour it or
    send it commands."""
    return _CONTROLS.sub(lambda m: m[0] if m[0] in keep else f"\\x{ord(m[0]):02x}", text)


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    got = f" (got {error['input'][:100]!r})" if error["type"] == "string_pattern_mismatch" else ""
    return f"{where}: {error['msg']}{got}"[:300]
