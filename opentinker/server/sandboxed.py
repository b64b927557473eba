"""The trusted side's handle on an attempt's sandboxed child: its scratch folder, cgroup, process and channel end.

``SandboxedChild`` starts ``job_child.py`` in bubblewrap (a fresh scratch folder at ``/job``, the upload read-only at
``/code``, the champion read-only) inside a cgroup with the tenant's limits, holding one end of a private socket pair;
``pump`` reads what it sends (``channel.py``): metrics to a callback, log lines into the flow run's log (bounded),
files streamed into the job's run folder (which no sandbox can write), and its one result.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentinker.infra.files import atomic_write
from opentinker.infra.settings import get_settings

from .channel import (
    Channel,
    ChannelError,
    Failure,
    FileBegin,
    Log,
    Metrics,
    Result,
    Start,
    escape_controls,
    safe_relative,
)
from .schemas import LaunchInfo

if TYPE_CHECKING:
    from opentinker.tasks.spec import RunSpec

SCRATCH_ROOT_VARIABLE = "OPENTINKER_SCRATCH_ROOT"
"""Where the worker keeps its attempts' scratch folders (outside every tenant's folder)."""
CHILD = ("-m", "opentinker.server.job_child")
SCRATCH = Path("/job")
"""The attempt's scratch folder inside the sandbox: its data dir, the only place it can write (besides /tmp)."""
CODE = Path("/code")
"""Where the sandbox sees the tenant's uploaded code (read-only)."""
MAX_FILE = 4 << 30
MAX_FILES = 16 << 30
MAX_OUTPUT_LINES = 5000
LIMITS_POLL_S = 0.5


class ChildFailed(RuntimeError):
    """The child ended without a result (its own error, a broken protocol, a killed process): worth one more try."""


class StorageFailed(RuntimeError):
    """A file the job sent could not be written into its run folder (a full disk, a storage fault): not the job's
    doing, so it is named as such rather than as the job's exit."""


class LimitExceeded(RuntimeError):
    """The child hit a limit of its cgroup (memory, processes): retrying would hit it again."""


class SandboxedChild:
    """The attempt's sandboxed child: a fresh scratch folder, a cgroup, the channel's other end, its process."""

    def __init__(
        self, launch: LaunchInfo, job_dir: Path, champion_dir: Path | None, log: Any, command: tuple[str, ...] = CHILD
    ):
        from .sandbox import Sandbox, base_env

        self.log = log
        self._lines = 0
        self._closed = False
        settings = get_settings()
        root = Path(os.environ.get(SCRATCH_ROOT_VARIABLE) or tempfile.gettempdir())
        self.scratch = Path(tempfile.mkdtemp(prefix="attempt-", dir=root))
        previous = job_dir / "checkpoints"
        if previous.is_dir():  # resume: a copy of the last checkpoint the job sent (the job's folder stays trusted)
            shutil.copytree(previous, self.scratch / "runs" / launch.job_id / "checkpoints")
        self.channel, theirs = (Channel(end) for end in socket.socketpair())
        self.cgroup = _cgroup(launch)
        sandboxed = settings.sandbox == "bwrap"
        env = {**launch.env, "OPENTINKER_JOB_ID": launch.job_id, "OPENTINKER_CHANNEL_FD": str(theirs.sock.fileno())}
        fds = [theirs.sock.fileno()]
        if sandboxed:
            from opentinker.infra.bwrap import pipe_with, seccomp_program

            readonly = [Path(p) for p in launch.readonly] + ([champion_dir] if champion_dir else [])
            code = ((Path(launch.code), CODE),) if launch.code else ()
            box = Sandbox(
                readonly=tuple(readonly),
                readonly_at=code,
                binds=((self.scratch, SCRATCH),),
                env={**env, "OPENTINKER_DATA_DIR": str(SCRATCH), **({"PYTHONPATH": str(CODE)} if code else {})},
                network=not launch.isolated,
            )
            seccomp = pipe_with(seccomp_program())
            fds.append(seccomp)
            argv, process_env = box.argv([sys.executable, *command], seccomp_fd=seccomp), {}
        else:  # OPENTINKER_SANDBOX=none: trusted tenants only (docs/service.md); the same channel, no namespaces
            argv = [sys.executable, *command]
            process_env = {**base_env(), **env, "OPENTINKER_DATA_DIR": str(self.scratch)}
            if launch.code:
                process_env["PYTHONPATH"] = launch.code
        if self.cgroup is not None:
            argv = self.cgroup.wrap(argv)
        self.process = subprocess.Popen(
            argv, pass_fds=fds, env=process_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for fd in fds[1:]:
            os.close(fd)
        theirs.close()
        self._output = threading.Thread(target=self._log_output, name="child-output", daemon=True)
        self._output.start()
        if self.cgroup is not None:
            threading.Thread(target=self._watch_limits, name="child-limits", daemon=True).start()

    def _watch_limits(self) -> None:
        """End the whole child as soon as it hits a limit: an out-of-memory kill takes only the largest process
        (cgroup v1), and what is left of the job would otherwise hang on it."""
        while self.process.poll() is None:
            if self.cgroup.limit_hit():
                self.cgroup.kill()
                return
            time.sleep(LIMITS_POLL_S)

    def _log_output(self) -> None:
        """The child's own output (prints, warnings, tracebacks) into the flow run's log, line by bounded line."""
        while line := self.process.stdout.readline(2000):
            self._log_line(line.decode(errors="replace").rstrip())

    def _log_line(self, line: str) -> None:
        """One line of the job's into the flow run's log, at most ``MAX_OUTPUT_LINES`` per child (output and ``log``
        messages together): a chatty job cannot fill Prefect's log store."""
        self._lines += 1
        if self._lines <= MAX_OUTPUT_LINES:
            self.log.info("job: %s", escape_controls(line))
        elif self._lines == MAX_OUTPUT_LINES + 1:
            self.log.warning("job: more output than %d lines; the rest is left out", MAX_OUTPUT_LINES)

    def start(self, spec: RunSpec, champion_dir: Path | None) -> None:
        self.channel.send(
            Start(spec=spec.model_dump(mode="json"), champion_dir=str(champion_dir) if champion_dir else None)
        )

    def pump(self, job_dir: Path, on_metrics: Any) -> Result:
        """Read the child's messages until it ends; files land in ``job_dir``. The result, or an error naming why
        there is none (the child's failure, a limit, a broken protocol)."""
        result: Result | None = None
        failure = ""
        try:
            for message in self.channel.messages(MAX_FILE, MAX_FILES):
                if isinstance(message, tuple):
                    _store(job_dir, *message)
                elif isinstance(message, Metrics):
                    on_metrics(dict(message.values), message.step)
                elif isinstance(message, Log):
                    self._log_line(message.line)
                elif isinstance(message, Failure):
                    failure = escape_controls(message.error, keep="\t\n")
                elif result is None:
                    result = message
        except (ChannelError, StorageFailed) as exc:
            failure = str(exc)
            self.kill()
        except OSError:
            pass  # the child's end broke between messages: it ended, and its exit code says how
        finally:
            self.channel.close()
        code = self.wait()
        limit = self.cgroup.limit_hit() if self.cgroup is not None else None
        if limit:
            raise LimitExceeded(limit)
        if result is None:
            last = failure.strip().splitlines()[-1] if failure.strip() else f"the job's process exited with {code}"
            raise ChildFailed(f"{last[:500]}\n{failure[-4000:]}" if failure else last)
        return result

    def wait(self) -> int:
        try:
            return self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.process.wait()

    def kill(self) -> None:
        if self.cgroup is not None:
            self.cgroup.kill()
        if self.process.poll() is None:
            self.process.kill()

    def close(self) -> None:
        """End the child (every process of its cgroup), remove its cgroup and scratch folder; once."""
        if self._closed:
            return
        self._closed = True
        self.kill()
        self.process.wait()
        self._output.join(timeout=5)
        if self.cgroup is not None:
            self.cgroup.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def _cgroup(launch: LaunchInfo) -> Any:
    """The attempt's cgroup with the tenant's limits, or None where limits are turned off (``job_limits = none``).
    Named after the job: one attempt of a job runs at a time, and the next finds a crashed one's cgroup and removes
    it."""
    from opentinker.infra.cgroups import JobLimits, job_cgroup

    return job_cgroup(launch.job_id, JobLimits(**launch.limits))


def _store(job_dir: Path, begin: FileBegin, chunks: Any) -> None:
    """A file the job sends, streamed by trusted code into the job's run folder (no sandbox can write there): a temp
    file renamed into place once its bytes and checksum are in, removed otherwise."""

    def write(handle: Any) -> None:
        for chunk in chunks:
            handle.write(chunk)

    try:
        atomic_write(job_dir / safe_relative(begin.path), write)
    except OSError as exc:  # the channel's own errors are ChannelErrors: an OSError here is the storage's
        raise StorageFailed(f"file {begin.path}: could not be stored in the job's run folder: {exc}") from exc
