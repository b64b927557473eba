"""Start, watch and stop long-running service processes on loopback.

Each service runs in its own session (process group) with stdout/stderr in a log file, so it outlives the
command that started it and ``stop`` can end it together with every child it spawned.
"""

from __future__ import annotations

import contextlib
import http.client
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
from typing import Any

import psutil


class ServiceError(RuntimeError):
    """A service did not start, or stopped, with the reason and the tail of its log."""

    def __init__(self, message: str, service: ServiceProcess | None = None):
        super().__init__(message)
        self.service = service
        """The process that failed (already stopped), for callers that read more of its log."""


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports the OS just handed out on ``host`` (all held open until every one is chosen)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
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
    if not path.is_file():
        return "(no log written)"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:]) or "(log is empty)"


def log_since(path: Path, offset: int) -> str:
    """What was appended to ``path`` after byte ``offset`` (a service's log across restarts is one file)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            return handle.read().decode(errors="replace")
    except (FileNotFoundError, IsADirectoryError):
        return ""


@dataclass
class ServiceProcess:
    """One running service: enough to find it again from another process and to stop only it."""

    name: str
    pid: int
    create_time: float
    url: str
    log: str
    """Its stdout and stderr (appended to across restarts); empty when it writes to ours."""
    ports: dict[str, int] = field(default_factory=dict)
    log_offset: int = 0
    """Where this start's output begins in ``log`` (after the line naming the command)."""
    boot_time: float = 0.0
    """``psutil.boot_time()`` when ``create_time`` was read. Start times are compared as offsets from boot: a stepped
    wall clock (NTP, a VM's clock sync) moves both psutil's boot time and its process start times, so a service
    recorded 11 minutes earlier read 20 s "younger" on the development VM and its worker was started again."""
    stop_command: list[str] = field(default_factory=list)
    """When set, the service is stopped by running this command (e.g. ``pg_ctl stop``) before signalling."""
    stop_timeout: float = 30.0
    """Seconds between SIGTERM and SIGKILL."""
    config: dict[str, str] = field(default_factory=dict)
    """The settings it was started with, so a later caller adopts it only when they still hold."""
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
            if abs(_since_boot(proc) - self._since_boot()) > 1.0 or proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except psutil.Error:
            return None

    def _since_boot(self) -> float:
        return self.create_time - self.boot_time

    def alive(self) -> bool:
        return self.process() is not None

    def log_text(self) -> str:
        """What this start of the service wrote to its log so far."""
        return log_since(Path(self.log), self.log_offset) if self.log else ""

    def exit_code(self, timeout: float = 5.0) -> int | None:
        """The exit status of a service that is no longer alive, known only in the process that started it.

        Waits up to ``timeout``: a multi-threaded process whose main thread has ended shows as a zombie while its
        other threads still finish, and cannot be reaped before they do.
        """
        if self.popen is None:
            return None
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

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
                if os.getpgid(proc.pid) == self.pid and _since_boot(proc) >= self._since_boot() - 1.0:
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
    log: Path | None,
    url: str,
    ports: dict[str, int],
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> ServiceProcess:
    """Start ``cmd`` in a new session, output appended to ``log`` (None: to ours); ``env`` is the whole
    environment (default: ours)."""
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("PYTHONUNBUFFERED", "1")  # a service that dies early leaves what it printed in its log
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") if log is not None else contextlib.nullcontext() as out:
        if out is not None:
            out.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(cmd)}\n".encode())
            out.flush()
        offset = out.tell() if out is not None else 0
        popen = subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
        )
    create_time = psutil.Process(popen.pid).create_time()
    return ServiceProcess(
        name=name,
        pid=popen.pid,
        create_time=create_time,
        boot_time=psutil.boot_time(),
        url=url,
        log=str(log or ""),
        ports=dict(ports),
        log_offset=offset,
        popen=popen,
    )


def start(
    name: str,
    cmd: Sequence[str],
    log: Path | None,
    *,
    ready: Callable[[], bool] | str,
    what: str,
    timeout: float,
    url: str = "",
    ports: dict[str, int] | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    fails_on: str | None = None,
    stop_command: Sequence[str] = (),
    stop_timeout: float = 30.0,
    startup_nice: int | None = None,
    error: type[ServiceError] = ServiceError,
) -> ServiceProcess:
    """``spawn`` then ``wait_until`` ready; a service that does not get there is stopped before ``error`` is raised.

    ``startup_nice`` raises the CPU share of the service's session while it starts (see ``set_session_priority``).
    """
    service = spawn(name, cmd, log, url=url, ports=ports or {}, env=env, cwd=cwd)
    service.stop_command, service.stop_timeout = list(stop_command), stop_timeout
    if startup_nice is not None:
        set_session_priority(service.pid, startup_nice)
    try:
        wait_until(service, ready, timeout, what, fails_on=fails_on, error=error)
    except BaseException:
        service.stop()
        raise
    finally:
        if startup_nice is not None:
            set_session_priority(service.pid, 0)
    return service


def start_http(
    name: str,
    cmd: Sequence[str],
    log: Path | None,
    *,
    port: int,
    health: str,
    timeout: float,
    host: str = "127.0.0.1",
    **options: Any,
) -> ServiceProcess:
    """``start`` for an HTTP service on ``host:port``, ready once its ``health`` path answers 2xx; ``url`` is its root.

    ``options`` are ``start``'s (``env``, ``cwd``, ``fails_on``, ``stop_timeout``, ``error``, ...).
    """
    url = f"http://{host}:{port}"
    return start(
        name,
        cmd,
        log,
        ready=lambda: http_ok(f"{url}{health}"),
        what=f"{url}{health} answered",
        timeout=timeout,
        url=url,
        ports={"http": port},
        **options,
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
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError):
        return False


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 2.0) -> bool:
    """True when something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_until(
    service: ServiceProcess,
    ready: Callable[[], bool] | str,
    timeout: float,
    what: str,
    *,
    fails_on: str | None = None,
    error: type[ServiceError] = ServiceError,
) -> None:
    """Poll ``ready`` (a check, or a line this start must log) until true; raise ``error`` with the log tail when
    the process dies, logs ``fails_on`` (a supervisor that keeps restarting a broken worker) or time runs out."""
    check = (lambda: ready in service.log_text()) if isinstance(ready, str) else ready
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not service.alive():
            code = service.exit_code()
            status = f" (exited with code {code})" if code is not None else ""
            raise error(f"{service.name} exited before {what}{status}. {_log_excerpt(service)}", service)
        if fails_on is not None and fails_on in service.log_text():
            raise error(f"{service.name} failed to start ({fails_on!r} in its log). {_log_excerpt(service)}", service)
        if check():
            return
        time.sleep(0.25)
    raise error(
        f"{service.name} did not become ready ({what}) within {timeout:.0f} s. {_log_excerpt(service)}", service
    )


def _log_excerpt(service: ServiceProcess) -> str:
    if not service.log:
        return "Its output went to the terminal."
    return f"Last lines of {service.log}:\n{log_tail(Path(service.log))}"


def _since_boot(proc: psutil.Process) -> float:
    """When ``proc`` started, in seconds after boot (see ``ServiceProcess.boot_time``)."""
    return proc.create_time() - psutil.boot_time()
