"""The boundary around a job's processes: bubblewrap namespaces, a read-only system and one private scratch folder.

Each job attempt runs in a fresh sandbox (``bwrap``, the tool ``opentinker/llm/sandbox.py`` already uses for model-
written code): new user, PID, IPC, UTS and cgroup namespaces, no capabilities, no nested user namespaces, the seccomp
filter of the LLM sandbox, its own session, and a filesystem of read-only binds of what Python needs (the system's
``/usr``, the interpreter, the virtualenv, the project's package folders), the base models and the champion
read-only, the tenant's uploaded code read-only at ``/code``, and, writable, only the attempt's own scratch folder at
``/job`` (made fresh by ``sandboxed.py``, outside every tenant's folder) and a fresh ``/tmp`` and ``/dev/shm``. The
environment is cleared and set to the job's alone. So the server's data dir (its key store), the rest of the
tenant's folder (its MLflow store, its jobs' run folders), other tenants' folders, ``/etc``, the homes and the
server's and worker's environments do not exist in there: what the job makes reaches them only as messages on its
channel (``channel.py``), which the trusted side validates and writes. The whole PID namespace, local Ray included,
dies with the sandbox: cancelling a job stops its work at once.

``network=False`` also gives the sandbox its own network namespace (only its own loopback): the submit-time env check
and every job of the embedded stack, whose only way out is that channel (a socket inherited as a descriptor). A job
for a configured Ray cluster shares the host's network: docs/service.md says what that leaves open.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from opentinker.flows.work_pool import SOURCE_ROOT
from opentinker.infra.bwrap import SandboxUnavailable, bwrap_path, pipe_with, probe, seccomp_program

UID = 65534
SYSTEM_SYMLINKS = ("/lib", "/lib64", "/lib32", "/bin", "/sbin")
SECCOMP_FD = 9
"""The descriptor bwrap reads the seccomp program from (``sh -c 'exec "$@" 9<FILE'``)."""

__all__ = ["SECCOMP_FD", "Sandbox", "SandboxUnavailable", "check_available"]


@dataclass(frozen=True)
class Sandbox:
    """One sandbox's layout: what it may write, what it reads on top of the system, its environment."""

    readonly: tuple[Path, ...] = ()
    binds: tuple[tuple[Path, Path], ...] = ()
    """(host path, sandbox path) pairs bound writable, e.g. a job attempt's scratch folder."""
    readonly_at: tuple[tuple[Path, Path], ...] = ()
    """(host path, sandbox path) pairs bound read-only, e.g. a tenant's uploaded code (its host path stays unknown)."""
    env: Mapping[str, str] = field(default_factory=dict)
    network: bool = True
    chdir: Path = SOURCE_ROOT

    def argv(self, command: Sequence[str], seccomp_fd: int = SECCOMP_FD) -> list[str]:
        """bwrap's command line running ``command`` inside (the seccomp program must be readable on ``seccomp_fd``)."""
        return [bwrap_path(), "--seccomp", str(seccomp_fd), *self.layout(command)]

    def layout(self, command: Sequence[str]) -> list[str]:
        """bwrap's arguments for this sandbox, then ``--`` and ``command``."""
        args = ["--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
        args += ["--unshare-cgroup-try", "--disable-userns", "--die-with-parent", "--new-session"]
        if not self.network:
            args.append("--unshare-net")
        args += ["--uid", str(UID), "--gid", str(UID), "--hostname", "job", "--clearenv"]
        for key, value in {**base_env(), **self.env}.items():
            args += ["--setenv", key, value]
        # The fresh /tmp first: binds may lie under /tmp and must land on top of it, not under it.
        args += ["--tmpfs", "/tmp", "--dev", "/dev", "--tmpfs", "/dev/shm", "--proc", "/proc"]
        args += list(_system_layout())
        for path in self.readonly:
            args += ["--ro-bind", str(path), str(path)]
        for source, target in self.binds:
            args += ["--bind", str(source), str(target)]
        for source, target in self.readonly_at:
            args += ["--ro-bind", str(source), str(target)]
        args += ["--chdir", str(self.chdir), "--", *command]
        return args

    def run(
        self, command: Sequence[str], input: str = "", timeout: float = 120.0, cgroup: Any = None
    ) -> subprocess.CompletedProcess:
        """Run ``command`` in this sandbox and wait (output captured as text); inside ``cgroup``
        (``infra.cgroups.JobCgroup``) when one is given."""
        seccomp = pipe_with(seccomp_program())
        argv = self.argv(command, seccomp_fd=seccomp)
        try:
            return subprocess.run(
                cgroup.wrap(argv) if cgroup is not None else argv,
                input=input,
                capture_output=True,
                text=True,
                timeout=timeout,
                pass_fds=(seccomp,),
                env={},
                check=False,
            )
        finally:
            os.close(seccomp)


def base_env() -> dict[str, str]:
    """What every sandboxed Python needs; nothing from the caller's environment."""
    return {
        "HOME": "/tmp",
        "USER": "job",
        "LANG": "C.UTF-8",
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def check_available() -> None:
    """Fail closed, naming what is missing, when bubblewrap cannot make a job's sandbox here."""
    probe(Sandbox(network=False).layout([sys.executable, "-I", "-S", "-c", "pass"]))


@lru_cache(maxsize=1)
def _system_layout() -> tuple[str, ...]:
    """Read-only binds: ``/usr`` (and the usual symlinks into it), the interpreter's installation, the virtualenv and
    the project's package folders (the editable install imports ``opentinker.*`` from them); not the repository
    itself, which may hold a data dir."""
    args = ["--ro-bind", "/usr", "/usr", "--ro-bind-try", "/etc/fonts", "/etc/fonts"]
    for path in SYSTEM_SYMLINKS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for prefix in dict.fromkeys((sys.base_prefix, sys.prefix, sysconfig.get_paths()["stdlib"])):
        if not prefix.startswith("/usr/"):
            args += ["--ro-bind", prefix, prefix]
    for folder in sorted(SOURCE_ROOT.iterdir()):
        if (folder / "__init__.py").is_file() and folder.name != "tests":
            args += ["--ro-bind", str(folder), str(folder)]
    return tuple(args)
