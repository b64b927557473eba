"""Start, watch and stop long-running service processes on loopback.

Each service runs in its own session (process group) with stdout/stderr in a log file, so it outlives the
command that started it and ``stop`` can end it together with every child it spawned.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import psutil


class ServiceError(RuntimeError):
    """A service did not start, or stopped, with the reason and the tail of its log."""


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (all sockets held open until every port is chosen)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def venv_bin(name: str) -> str:
    """Path of a console script installed next to the running interpreter (the project's venv)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def log_tail(path: Path, lines: int = 30) -> str:
    if not path.exists():
        return "(no log written)"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:]) or "(log is empty)"


def log_since(path: Path, offset: int) -> str:
    """What was appended to ``path`` after byte ``offset`` (a service's log across restarts is one file)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            return handle.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def write_json_atomic(path: Path, data: object) -> None:
    """Write JSON to a temp file and rename it, so a crash never leaves a half-written state file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def write_private(path: Path, text: str) -> None:
    """Atomically write a file only its owner can read (keys, secrets): created 0600, never briefly wider."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


@dataclass
class ServiceProcess:
    """One running service: enough to find it again from another process and to stop only it."""

    name: str
    pid: int
    create_time: float
    url: str
    log: str
    ports: dict[str, int] = field(default_factory=dict)
    stop_command: list[str] = field(default_factory=list)
    """When set, the service is stopped by running this command (e.g. ``pg_ctl stop``) before signalling."""
    stop_timeout: float = 30.0
    """Seconds between SIGTERM and SIGKILL."""
    popen: subprocess.Popen | None = field(default=None, repr=False, compare=False)
    """Set only in the process that started the service, so it can reap its child."""

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "popen"}

    @classmethod
    def from_dict(cls, data: Mapping) -> ServiceProcess:
        return cls(**data)

    def process(self) -> psutil.Process | None:
        """The live process this record describes, or None (dead, or its pid now belongs to another process)."""
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.create_time) > 1.0 or proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except psutil.Error:
            return None

    def alive(self) -> bool:
        return self.process() is not None

    def stop(self, timeout: float | None = None) -> None:
        """Stop the service and every process of its group or tree (TERM, then KILL after ``timeout``), and wait.

        Works even when the leader already died: leftovers of its process group are still found and stopped.
        """
        timeout = self.stop_timeout if timeout is None else timeout
        if self.stop_command and self.alive():
            subprocess.run(
                self.stop_command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout, check=False
            )
        family = self.family()
        _signal_all(family, signal.SIGTERM)
        psutil.wait_procs(family, timeout=timeout)
        leftovers = self.family()
        if leftovers:
            _signal_all(leftovers, signal.SIGKILL)
            psutil.wait_procs(leftovers, timeout=10)
        self._reap()

    def family(self) -> list[psutil.Process]:
        """The leader, its descendants, and any process still in its process group started after it.

        Once the leader is gone and its pid belongs to another process, the group is gone too (Linux reuses a
        pid only when no process group of that id is left): processes in group ``pid`` are then that stranger's.
        """
        members: dict[int, psutil.Process] = {}
        leader = self.process()
        if leader is None and psutil.pid_exists(self.pid) and _running(_process_or_none(self.pid)):
            return []
        if leader is not None:
            members[leader.pid] = leader
            try:
                members.update((child.pid, child) for child in leader.children(recursive=True))
            except psutil.Error:
                pass
        for proc in psutil.process_iter():
            try:
                if os.getpgid(proc.pid) == self.pid and proc.create_time() >= self.create_time - 1.0:
                    members.setdefault(proc.pid, proc)
            except (psutil.Error, OSError):
                continue
        return [proc for proc in members.values() if _running(proc)]

    def _reap(self) -> None:
        if self.popen is not None:
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def _process_or_none(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _running(proc: psutil.Process | None) -> bool:
    if proc is None:
        return False
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal_all(procs: Sequence[psutil.Process], sig: int) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass


def spawn(
    name: str,
    cmd: Sequence[str],
    log: Path,
    url: str,
    ports: dict[str, int],
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> ServiceProcess:
    """Start ``cmd`` in a new session, output appended to ``log``; ``env`` is the whole environment (default: ours)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("PYTHONUNBUFFERED", "1")  # a service that dies early leaves what it printed in its log
    with open(log, "ab") as out:
        out.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(cmd)}\n".encode())
        out.flush()
        popen = subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
        )
    create_time = psutil.Process(popen.pid).create_time()
    return ServiceProcess(
        name=name, pid=popen.pid, create_time=create_time, url=url, log=str(log), ports=dict(ports), popen=popen
    )


def set_session_priority(pid: int, nice: int) -> bool:
    """Set the CPU weight (nice) of the scheduler autogroup of ``pid``'s session; False where not allowed/supported.

    With Linux autogroups every session gets an equal CPU share whatever its process count, so a service that
    starts many processes in one session (a Ray node) can starve on a busy machine.
    """
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
        return True
    except OSError:
        return False


def http_ok(url: str, timeout: float = 3.0) -> bool:
    """True when ``url`` answers with a 2xx status."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return 200 <= response.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_until(service: ServiceProcess, ready: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``ready`` until true; raise ``ServiceError`` with the log tail if the process dies or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not service.alive():
            raise ServiceError(
                f"{service.name} exited before {what}. Last lines of {service.log}:\n{log_tail(Path(service.log))}"
            )
        if ready():
            return
        time.sleep(0.5)
    raise ServiceError(
        f"{service.name} did not become ready ({what}) within {timeout:.0f} s. "
        f"Last lines of {service.log}:\n{log_tail(Path(service.log))}"
    )
