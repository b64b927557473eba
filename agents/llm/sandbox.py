"""Run untrusted Python in a throw-away subprocess with OS limits and an in-process guard.

Layers, outermost first (each one alone is not a security boundary; together they make escapes loud):
- a fresh network namespace (``unshare --net``) when the host allows it: no interfaces, no network;
- a new session/process group killed as a whole on wall-time expiry;
- rlimits set before user code runs: address space, CPU seconds, processes, file size, open files;
- a CPython audit hook that refuses sockets, subprocesses/forks, ctypes and any ``open`` outside the
  sandbox's temp dir (imports from the interpreter's own folders stay readable);
- stdout/stderr written to a size-capped file in the temp dir, read back truncated.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_BOOTSTRAP = Path(__file__).with_name("_sandbox_boot.py")


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one run."""

    wall_time_s: float = 10.0
    """Wall-clock limit; the whole process group is killed when it expires (infinite loops, sleeps)."""
    memory_mb: int = 512
    """Address-space limit (RLIMIT_AS); allocations beyond it raise MemoryError in the child."""
    max_output_chars: int = 4000
    """Characters of combined stdout/stderr returned to the caller; the rest is cut and marked."""
    max_file_mb: int = 8
    """Largest file the child may write (RLIMIT_FSIZE), its captured output included."""
    max_processes: int = 64
    """RLIMIT_NPROC (fork bombs; the kernel does not apply it to root, where the audit guard's refusal of
    fork/spawn/subprocess is what stops them)."""

    def __post_init__(self) -> None:
        for name in ("wall_time_s", "memory_mb", "max_output_chars", "max_file_mb", "max_processes"):
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
    """Execute ``code`` in a sandboxed interpreter; never raises for anything the code does."""
    if not isinstance(code, str):
        raise TypeError(f"code: expected a string, got {type(code).__name__}")
    limits = limits or SandboxLimits()
    workdir = Path(tempfile.mkdtemp(prefix="opentinker-sandbox-"))
    try:
        return _run_in(workdir, code, limits)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_in(workdir: Path, code: str, limits: SandboxLimits) -> SandboxResult:
    out_path = workdir / ".output"
    argv = [sys.executable, "-I", str(_BOOTSTRAP), str(workdir), str(limits.memory_mb),
            str(int(limits.wall_time_s) + 2), str(limits.max_processes), str(limits.max_file_mb)]
    isolated = _netns_available()
    if isolated:
        argv = ["unshare", "--net", "--", *argv]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    started = time.monotonic()
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            proc.communicate(code.encode(), timeout=limits.wall_time_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc)
    raw = out_path.read_bytes()[: limits.max_output_chars * 4].decode("utf-8", errors="replace")
    return SandboxResult(output=raw[: limits.max_output_chars], exit_code=None if timed_out else proc.returncode,
                         timed_out=timed_out, truncated=len(raw) > limits.max_output_chars or
                         out_path.stat().st_size > limits.max_output_chars * 4,
                         duration_s=time.monotonic() - started, network_isolated=isolated)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill everything the run started (its own session), then reap the direct child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


_NETNS: bool | None = None


def _netns_available() -> bool:
    """Whether ``unshare --net`` works here (root or unprivileged user namespaces); probed once."""
    global _NETNS
    if _NETNS is None:
        exe = shutil.which("unshare")
        try:
            _NETNS = bool(exe) and subprocess.run([exe, "--net", "--", "true"], capture_output=True,
                                                  timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            _NETNS = False
    return _NETNS


def _signal_name(code: int) -> str:
    if code < 0:
        try:
            return f", {signal.Signals(-code).name}"
        except ValueError:
            return ""
    return ""
