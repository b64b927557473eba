"""Run untrusted Python inside a bubblewrap sandbox: one throw-away set of namespaces per call.

The boundary is the kernel's, set up by bubblewrap (``bwrap``, what Flatpak uses), and holds whatever the code does:
- new user, PID, mount, IPC, UTS, cgroup and network namespaces; uid/gid 65534 with no capabilities, no new
  privileges and no nested user namespaces; its own session; the whole PID namespace dies with the call;
- a filesystem of read-only binds: the interpreter, its stdlib, the system's shared libraries and the packages in
  ``SANDBOX_PACKAGES`` (not the project, not ``/etc``, not any home); the only writable place is a tmpfs at ``/tmp``
  capped at ``disk_mb``; a cleared environment;
- a seccomp filter (libseccomp) that fails mount, ptrace, namespace, keyring, bpf, perf, io_uring and
  kernel-module calls with EPERM;
- a process limit that holds for any uid: RLIMIT_NPROC for a non-root caller, whose uid the sandbox maps to; a
  per-call pids cgroup for root (the kernel exempts root-mapped processes from RLIMIT_NPROC);
- rlimits set before the code runs: address space, CPU seconds, file size, open files; output read through a
  pipe, the sandbox killed once it passes the cap.
A CPython audit hook (``_sandbox_boot.py``) is a second layer that turns most attempts into a readable refusal;
it is not a boundary. Without bwrap or user namespaces the call raises ``SandboxUnavailable`` (fail closed);
``OPENTINKER_SANDBOX=none`` opts out for trusted local use (the audit hook and rlimits only).
"""

from __future__ import annotations

import errno
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from opentinker.infra.bwrap import SandboxUnavailable, bwrap_path, pipe_with, probe, seccomp_program
from opentinker.infra.settings import get_settings

_BOOTSTRAP = Path(__file__).with_name("_sandbox_boot.py")
SANDBOX_PACKAGES = ("numpy", "sympy", "mpmath")
"""Installed distributions the sandboxed code may import, besides the standard library."""
_SITE = "/site-packages"
_WORKDIR = "/tmp"
_UID = 65534  # nobody
_SYSTEM_LIBS = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/lib32", "/usr/lib32")
_ENV = {
    "HOME": _WORKDIR,
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one run."""

    wall_time_s: float = 10.0
    """Wall-clock limit; the sandbox (every process in it) is killed when it expires."""
    memory_mb: int = 512
    """Address-space limit per process (RLIMIT_AS); allocations beyond it raise MemoryError in the child."""
    max_output_chars: int = 4000
    """Characters of combined stdout/stderr returned to the caller; past 4x this many bytes the run is killed."""
    max_file_mb: int = 8
    """Largest single file the child may write (RLIMIT_FSIZE)."""
    max_processes: int = 16
    """Processes and threads the run may have at once (RLIMIT_NPROC, or a pids cgroup when running as root)."""
    disk_mb: int = 64
    """Size of the writable tmpfs at /tmp, everything the run writes together."""

    def __post_init__(self) -> None:
        for name in ("wall_time_s", "memory_mb", "max_output_chars", "max_file_mb", "max_processes", "disk_mb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name}: expected a positive number, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class SandboxResult:
    """What happened to one run: its (truncated) output and how it ended."""

    output: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    duration_s: float
    network_isolated: bool

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def report(self) -> str:
        """The text a model sees: the output plus a one-line verdict when the run did not end cleanly."""
        text = self.output.rstrip()
        if self.truncated:
            text += "\n[output truncated]"
        if self.timed_out:
            text += "\n[killed: wall-time limit exceeded]"
        elif self.exit_code not in (0, None):
            text += f"\n[exit code {self.exit_code}{_signal_name(self.exit_code)}]"
        return text.strip() or "[no output]"


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Execute ``code`` in the sandbox; never raises for anything the code does.

    Raises ``SandboxUnavailable`` when the isolation cannot be set up (bwrap missing, namespaces refused).
    """
    if not isinstance(code, str):
        raise TypeError(f"code: expected a string, got {type(code).__name__}")
    limits = limits or SandboxLimits()
    if get_settings().sandbox == "none":
        workdir = tempfile.mkdtemp(prefix="opentinker-sandbox-")
        try:
            argv = _boot_argv(sys.executable, workdir, sysconfig.get_paths()["purelib"], limits)
            return _execute(argv, code, limits, cwd=workdir, info_r=None, pass_fds=())
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    bwrap = bwrap_path()
    probe([*_layout(), "--", _interpreter(), "-I", "-S", "-c", "pass"])
    bpf, pids_root = seccomp_program(), _pids_cgroup()
    cgroup = pids_root / f"opentinker-sandbox-{uuid.uuid4().hex}" if pids_root else None
    info_r, info_w = os.pipe()
    seccomp = pipe_with(bpf)
    try:
        argv = [
            bwrap,
            *_layout(),
            "--size",
            str(limits.disk_mb * 1024 * 1024),
            "--tmpfs",
            _WORKDIR,
            "--remount-ro",
            "/",
            "--chdir",
            _WORKDIR,
            "--seccomp",
            str(seccomp),
            "--info-fd",
            str(info_w),
            "--",
            *_boot_argv(_interpreter(), _WORKDIR, _SITE, limits),
        ]
        if cgroup is not None:
            cgroup.mkdir()
            (cgroup / "pids.max").write_text(str(limits.max_processes + 2))  # + bwrap's own two processes
            argv = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"), *argv]
        return _execute(argv, code, limits, cwd="/", info_r=info_r, pass_fds=(seccomp, info_w))
    finally:
        os.close(info_r)
        if cgroup is not None and cgroup.exists():
            _remove_cgroup(cgroup)


def _boot_argv(python: str, workdir: str, site: str, limits: SandboxLimits) -> list[str]:
    return [
        python,
        "-I",
        "-S",
        "-B",
        "-c",
        _boot_source(),
        workdir,
        str(limits.memory_mb),
        str(int(limits.wall_time_s) + 2),
        str(limits.max_processes),
        str(limits.max_file_mb),
        site,
    ]


def _execute(
    argv: list[str], code: str, limits: SandboxLimits, cwd: str, info_r: int | None, pass_fds: tuple[int, ...]
) -> SandboxResult:
    """Start ``argv`` (it owns ``pass_fds`` from here), feed it the code, collect output until exit or a limit."""
    env = {} if info_r is not None else {**_ENV, "HOME": cwd}  # bwrap sets the sandbox's own
    started = time.monotonic()
    deadline = started + limits.wall_time_s
    try:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=pass_fds,
        )
    finally:
        for fd in pass_fds:
            os.close(fd)  # the child holds them now; the info pipe sees EOF once bwrap is done with it
    try:
        proc.stdin.write(code.encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    cap = limits.max_output_chars * 4
    buf, timed_out, flooded = bytearray(), False, False
    out = proc.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        if not select.select([out], [], [], left)[0]:
            continue
        chunk = os.read(out, 65536)
        if not chunk:
            break  # every process in the sandbox has closed its output
        buf += chunk
        if len(buf) > cap:
            flooded = True
            break
    if not (timed_out or flooded):
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            timed_out = True
    if timed_out or flooded:
        _kill(proc, info_r)
    proc.wait()  # with bwrap this returns once the sandbox's PID namespace is empty
    proc.stdout.close()
    raw = bytes(buf[:cap]).decode("utf-8", errors="replace")
    return SandboxResult(
        output=raw[: limits.max_output_chars],
        exit_code=None if timed_out else proc.returncode,
        timed_out=timed_out,
        truncated=flooded or len(raw) > limits.max_output_chars,
        duration_s=time.monotonic() - started,
        network_isolated=info_r is not None,
    )


def _kill(proc: subprocess.Popen, info_r: int | None) -> None:
    """SIGKILL the sandbox's PID 1: the kernel kills its whole namespace, and bwrap exits once that is done.

    Without bwrap (or before it started the sandbox) kill the process group instead.
    """
    target, kill = (proc.pid, os.killpg)
    child = _sandbox_pid1(info_r) if info_r is not None else None
    if child is not None:
        target, kill = child, os.kill
    try:
        kill(target, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _sandbox_pid1(info_r: int) -> int | None:
    """The host pid of the sandbox's PID 1, from bwrap's ``--info-fd`` JSON (None if bwrap never got that far)."""
    data = b""
    while select.select([info_r], [], [], 1.0)[0]:
        chunk = os.read(info_r, 4096)
        if not chunk:
            break
        data += chunk
    try:
        return int(json.loads(data)["child-pid"])
    except (ValueError, KeyError):
        return None


@lru_cache(maxsize=1)
def _pids_cgroup() -> Path | None:
    """Where per-call pids cgroups go when running as root (the kernel exempts a root-mapped sandbox from
    RLIMIT_NPROC); None for other users, whose sandbox RLIMIT_NPROC binds."""
    if os.geteuid() != 0:
        return None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            base = Path("/sys/fs/cgroup/pids", path.lstrip("/"))
        elif not controllers:
            base = Path("/sys/fs/cgroup", path.lstrip("/"))
            control = base / "cgroup.subtree_control"
            if not (control.exists() and "pids" in control.read_text().split()):
                continue
        else:
            continue
        if os.access(base, os.W_OK):
            return base
    raise SandboxUnavailable(
        "running as root, the sandbox's process limit needs a writable cgroup with the pids "
        "controller (cgroup v1 /sys/fs/cgroup/pids, or v2 with pids delegated to this "
        "process's cgroup); run as a non-root user instead, or set OPENTINKER_SANDBOX=none on "
        "a trusted machine"
    )


def _remove_cgroup(cgroup: Path) -> None:
    """rmdir once the kernel has detached the last (already reaped) task; that lags the reaping by moments."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            cgroup.rmdir()
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.002)


@lru_cache(maxsize=1)
def _boot_source() -> str:
    return _BOOTSTRAP.read_text()


@lru_cache(maxsize=1)
def _layout() -> tuple[str, ...]:
    """bwrap's namespace, identity and read-only filesystem arguments (the same for every call)."""
    args = [
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--uid",
        str(_UID),
        "--gid",
        str(_UID),
        "--hostname",
        "sandbox",
        "--clearenv",
    ]
    for key, value in _ENV.items():
        args += ["--setenv", key, value]
    for path in _SYSTEM_LIBS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    stdlib = sysconfig.get_paths()["stdlib"]
    args += ["--ro-bind", _interpreter(), _interpreter(), "--ro-bind", stdlib, stdlib]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        libpython = os.path.join(sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME"))
        if os.path.exists(libpython) and not libpython.startswith(tuple(p + "/" for p in _SYSTEM_LIBS)):
            args += ["--ro-bind", libpython, libpython]
    for name in SANDBOX_PACKAGES:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for top in sorted({f.parts[0] for f in dist.files or () if f.parts[0] != ".."}):
            source = dist.locate_file(top)
            if os.path.exists(source):
                args += ["--ro-bind", str(source), f"{_SITE}/{top}"]
    # /proc read-only: the sysctls under /proc/sys check the host uid, which is 0 when the caller is root
    return (*args, "--proc", "/proc", "--remount-ro", "/proc", "--dev", "/dev", "--remount-ro", "/dev")


@lru_cache(maxsize=1)
def _interpreter() -> str:
    """The real interpreter binary (a venv's python is a symlink to it): the sandbox runs it without the venv."""
    return os.path.realpath(sys.executable)


def _signal_name(code: int) -> str:
    if code < 0:
        try:
            return f", {signal.Signals(-code).name}"
        except ValueError:
            return ""
    return ""
