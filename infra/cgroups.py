"""Per-job limits on memory, processes and CPU: one kernel cgroup per job attempt.

bubblewrap (``opentinker/server/sandbox.py``) decides what a job can see; it bounds nothing the job uses. Without
limits one tenant's job can fork until the machine's process table is full or allocate until the kernel's OOM killer
takes the server. So the trusted worker starts each attempt in a fresh cgroup of its own:

    limits = limits_for(tenant_row, settings)
    with JobCgroup.create(f"job-{job_id}-{attempt}", limits) as cgroup:
        proc = subprocess.Popen(cgroup.wrap(sandbox_argv), pass_fds=(seccomp_fd,), env={})
        ...                          # poll ``cgroup.limit_hit()`` while it runs; on a reason, ``cgroup.kill()``
        reason = cgroup.limit_hit()  # after it ended: None, or 'memory limit 4 GiB exceeded'
    # leaving the block kills whatever is left and removes the cgroup

``wrap`` puts a ``/bin/sh`` in front of the command that writes its own pid into the cgroup, then ``exec``s the
command: the command and every descendant are inside from their first instruction (no window between fork and a
later "move"), no ``preexec_fn`` runs in a threaded worker, and descriptors passed with ``pass_fds`` reach the
command unchanged. If the shell cannot join, it exits 125 without running anything (fail closed).

cgroup v2 is used where the calling process's own cgroup in a writable unified hierarchy offers the controllers the
limits need; otherwise v1, one directory per controller. The cgroups nest under the worker's own cgroup
(``<hierarchy>/<worker's cgroup>/opentinker/<name>``; the hierarchy's root on a plain host), so whatever limits the
operator put on the server's cgroup bound its jobs too. On v2 a cgroup that holds processes cannot enable
controllers for its children, so the processes of the worker's own cgroup first move into a leaf of it (``LEAF``).
Without a usable controller, ``JobCgroup.create`` raises ``CgroupUnavailable`` naming what is missing;
``OPENTINKER_JOB_LIMITS=none`` opts out on a trusted machine.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .settings import Settings

log = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30
TRACKED = frozenset(("memory", "pids"))
"""Controllers a job's cgroup joins even when it sets no limit there (to count, and to find its processes)."""
PARENT = "opentinker"
"""The folder under the worker's own cgroup that holds one cgroup per job attempt."""
LEAF = "opentinker-worker"
"""cgroup v2 only: the leaf the processes of the worker's own cgroup move into, so that cgroup may enable controllers
for its jobs' (v2 lets a cgroup that holds processes enable none: "no internal processes"; e.g. a Kubernetes pod's or
a systemd service's cgroup holding the worker). The worker's base stays the cgroup above the leaf."""
CPU_PERIOD_US = 100_000
JOIN_FAILED = 125
"""Exit status of ``wrap``'s shell when it could not join the cgroup (the command did not run)."""
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
V1_CONTROLLERS = frozenset(
    "cpu cpuacct cpuset memory devices freezer net_cls blkio perf_event net_prio hugetlb pids rdma misc".split()
)
_JOIN_SCRIPT = f'while [ "$1" != -- ]; do echo $$ >"$1" || exit {JOIN_FAILED}; shift; done; shift; exec "$@"'


class CgroupUnavailable(RuntimeError):
    """No cgroup with the controllers the limits need can be made here; nothing was started."""


class CgroupError(RuntimeError):
    """A cgroup could not be set up or removed (the message names the file and the kernel's answer)."""


@dataclass(frozen=True)
class JobLimits:
    """What one job attempt may use; None leaves that resource unbounded."""

    memory_bytes: int | None = None
    """Resident memory of every process of the attempt together (no swap beyond it); over it the kernel OOM-kills."""
    max_processes: int | None = None
    """Processes and threads alive at once (the pids controller counts both); a fork over it fails with EAGAIN."""
    cpus: float | None = None
    """CPU time as a number of cores (1.5: 150 ms per 100 ms period); None: every core, only niceness applies."""

    def __post_init__(self) -> None:
        # From JSON (``JobLimits(**dataclasses.asdict(limits))`` through a ``dict[str, float]``) counts come back as
        # floats: keep them whole numbers.
        for name in ("memory_bytes", "max_processes"):
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer():
                object.__setattr__(self, name, int(value))
            elif value is not None and not isinstance(value, int):
                raise ValueError(f"{name}: expected a whole number or None (got {value!r})")
        if self.memory_bytes is not None and self.memory_bytes < 4 * MiB:
            raise ValueError(f"memory_bytes: expected at least 4 MiB or None (got {self.memory_bytes!r})")
        if self.max_processes is not None and self.max_processes < 1:
            raise ValueError(f"max_processes: expected at least 1 or None (got {self.max_processes!r})")
        if self.cpus is not None and not self.cpus >= 0.01:
            raise ValueError(f"cpus: expected at least 0.01 or None (got {self.cpus!r})")

    @property
    def controllers(self) -> frozenset[str]:
        """The controllers these limits need."""
        wanted = {"memory": self.memory_bytes, "pids": self.max_processes, "cpu": self.cpus}
        return frozenset(name for name, value in wanted.items() if value is not None)

    def describe(self) -> str:
        """One line for logs: 'memory 8 GiB, 512 processes, all CPUs'."""
        memory = f"memory {format_bytes(self.memory_bytes)}" if self.memory_bytes else "memory unbounded"
        processes = f"{self.max_processes} processes" if self.max_processes else "processes unbounded"
        cpus = f"{self.cpus:g} CPUs" if self.cpus else "all CPUs"
        return f"{memory}, {processes}, {cpus}"


def format_bytes(size: int) -> str:
    """A size as people write it: '256 MiB', '4 GiB', '4.8 GiB'."""
    if size >= GiB:
        return f"{size // GiB} GiB" if size % GiB == 0 else f"{size / GiB:.1f} GiB"
    if size >= MiB:
        return f"{size // MiB} MiB" if size % MiB == 0 else f"{size / MiB:.1f} MiB"
    return f"{size} bytes"


def default_memory_bytes() -> int:
    """The embedded stack's default: 60% of this machine's memory, at most 8 GiB, in whole MiB."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(8 * GiB, int(total * 0.6) // MiB * MiB)


def limits_for(tenant: Any, settings: Settings | None = None) -> JobLimits:
    """A job's limits: the tenant's quota fields (``job_memory_mb``, ``job_max_processes``, ``job_cpus``: a ``Tenant``
    row, ``Quotas`` or None), each unset one (None) from the server's settings of the same name."""
    from .settings import get_settings

    settings = settings or get_settings()

    def pick(field: str) -> Any:
        value = getattr(tenant, field, None) if tenant is not None else None
        return value if value is not None else getattr(settings, field)

    memory_mb = pick("job_memory_mb")
    return JobLimits(
        memory_bytes=memory_mb * MiB if memory_mb is not None else default_memory_bytes(),
        max_processes=pick("job_max_processes"),
        cpus=pick("job_cpus"),
    )


# --- finding the hierarchies ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Hierarchy:
    version: int
    controllers: frozenset[str]
    base: Path
    """The calling process's own cgroup in this hierarchy (where ``opentinker/<name>`` is made)."""


def _hierarchies(
    mountinfo: Path = Path("/proc/self/mountinfo"), own: Path = Path("/proc/self/cgroup")
) -> list[_Hierarchy]:
    """Every mounted cgroup hierarchy, v2 first, each with the caller's own cgroup folder in it."""
    own_paths: dict[str, str] = {}  # "memory" -> "/x/y"; "" (v2) -> "/x"
    for line in own.read_text().splitlines():
        _, names, path = line.split(":", 2)
        for name in names.split(",") if names else [""]:
            own_paths.setdefault(name, path)
    found: list[_Hierarchy] = []
    seen: set[str] = set()
    for line in mountinfo.read_text().splitlines():
        fields = line.split()
        dash = fields.index("-")
        fstype, options = fields[dash + 1], fields[dash + 3].split(",")
        root, point = _unescape(fields[3]), _unescape(fields[4])
        if fstype == "cgroup2":
            key, controllers = "", None
        elif fstype == "cgroup":
            controllers = frozenset(options) & V1_CONTROLLERS
            key = next(iter(sorted(controllers)), "")
            if not controllers:
                continue  # a named hierarchy (name=systemd): no resource controller
        else:
            continue
        if key in seen or key not in own_paths:
            continue
        seen.add(key)
        base = _own_folder(Path(point), root, own_paths[key])
        if controllers is None:
            base = base.parent if base.name == LEAF else base
            controllers = frozenset(_read(base / "cgroup.controllers", "").split())
            found.insert(0, _Hierarchy(2, controllers, base))
        else:
            found.append(_Hierarchy(1, controllers, base))
    return found


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def _own_folder(point: Path, root: str, path: str) -> Path:
    """The folder of cgroup ``path`` under a mount of the hierarchy's ``root`` at ``point`` (the mount itself when
    the caller's cgroup lies outside what is mounted)."""
    relative = os.path.relpath(path, root)
    if relative.startswith(".."):
        return point
    folder = point / relative if relative != "." else point
    return folder if folder.is_dir() else point


def _plan(limits: JobLimits) -> tuple[int, dict[str, Path], list[Path]]:
    """(cgroup version, {controller: its folder to make ``opentinker/<name>`` in}, those folders each once)."""
    required = limits.controllers
    wanted = required | TRACKED
    hierarchies = _hierarchies()
    problems = []
    v2 = next((h for h in hierarchies if h.version == 2), None)
    if v2 is not None:
        if required <= v2.controllers and os.access(v2.base, os.W_OK):
            # A v2 cgroup without controllers still holds the processes (to kill them whole): nothing else needed.
            return 2, dict.fromkeys(sorted(v2.controllers & wanted), v2.base), [v2.base]
        problems.append(
            f"cgroup v2 at {v2.base} offers {', '.join(sorted(v2.controllers)) or 'no controller'}"
            + ("" if os.access(v2.base, os.W_OK) else f" and is not writable by uid {os.geteuid()}")
        )
    v1 = {c: h for h in hierarchies if h.version == 1 for c in sorted(h.controllers & wanted)}
    writable = {c: h.base for c, h in v1.items() if os.access(h.base, os.W_OK)}
    missing = sorted(required - writable.keys()) if required or writable else sorted(TRACKED)
    if not missing:
        return 1, writable, list(dict.fromkeys(writable.values()))
    for name in missing:
        problems.append(
            f"cgroup v1 {name} is not writable by uid {os.geteuid()} at {v1[name].base}"
            if name in v1
            else f"cgroup v1 has no {name} controller mounted"
        )
    raise CgroupUnavailable(
        f"job limits need the cgroup controllers {', '.join(missing)}, but {'; '.join(problems)}: run the worker as "
        "root (or in a cgroup delegated to it) on a host with these controllers, or set OPENTINKER_JOB_LIMITS=none "
        "to run jobs without limits on a trusted machine"
    )


def check_available(limits: JobLimits | None = None) -> str:
    """Which cgroups jobs would get ('cgroup v1: memory, pids'); raises ``CgroupUnavailable`` naming what is missing."""
    version, dirs, _ = _plan(limits or JobLimits(memory_bytes=GiB, max_processes=512))
    return f"cgroup v{version}: {', '.join(sorted(dirs)) or 'no controller'}"


def available(limits: JobLimits | None = None) -> bool:
    try:
        check_available(limits)
    except (CgroupUnavailable, OSError):
        return False
    return True


def job_cgroup(name: str, limits: JobLimits, settings: Settings | None = None) -> JobCgroup | None:
    """``JobCgroup.create(name, limits)``, or None when ``job_limits`` is 'none' (the operator opted out)."""
    from .settings import get_settings

    if (settings or get_settings()).job_limits == "none":
        return None
    return JobCgroup.create(name, limits)


# --- one job's cgroup ------------------------------------------------------------------------------------------------


class JobCgroup:
    """One job attempt's cgroup (v2: one folder; v1: one folder per controller). ``create`` makes it, ``wrap`` starts
    a command inside, ``limit_hit`` says which limit ended it, ``kill`` and ``close`` end it; a context manager."""

    def __init__(self, name: str, limits: JobLimits, version: int, dirs: dict[str, Path], paths: Sequence[Path]):
        self.name = name
        self.limits = limits
        self.version = version
        self.dirs = dirs
        """Controller -> this job's folder (the same folder for every controller on v2)."""
        self.paths = tuple(paths)
        """This job's folders, each once (v2: one)."""

    @classmethod
    def create(cls, name: str, limits: JobLimits) -> JobCgroup:
        """Make the cgroup ``name`` (a job attempt's id) with ``limits``. A cgroup of that name left by a worker that
        crashed is killed and removed first. Raises ``CgroupUnavailable`` when the host cannot limit this job."""
        if not NAME_PATTERN.match(name):
            raise ValueError(f"cgroup name: expected 1-128 characters of A-Z, a-z, 0-9, '_', '.', '-' (got {name!r})")
        version, bases, folders = _plan(limits)
        dirs = {controller: base / PARENT / name for controller, base in bases.items()}
        cgroup = cls(name, limits, version, dirs, [base / PARENT / name for base in folders])
        try:
            for path in cgroup.paths:
                if path.exists():
                    log.warning("removing the stale cgroup %s (a worker ended without closing it)", path)
                    if not _remove_tree(path, timeout=10.0):
                        raise CgroupError(
                            f"stale cgroup {path} still holds processes that did not die (or a child "
                            "of this worker that was killed but not waited for)"
                        )
                _make(path, enable=sorted(dirs) if version == 2 else ())
            cgroup._apply()
        except BaseException:
            cgroup.close()
            raise
        log.info("cgroup v%d %s: %s", version, name, limits.describe())
        return cgroup

    def _apply(self) -> None:
        limits, dirs = self.limits, self.dirs
        if self.version == 2:
            folder = self.paths[0]
            if limits.memory_bytes is not None:
                _write(folder / "memory.max", limits.memory_bytes)
                _write_if_present(folder / "memory.swap.max", 0)
                _write_if_present(folder / "memory.oom.group", 1)  # an OOM ends the whole attempt, not one process
            if limits.max_processes is not None:
                _write(folder / "pids.max", limits.max_processes)
            if limits.cpus is not None:
                _write(folder / "cpu.max", f"{_cpu_quota(limits.cpus)} {CPU_PERIOD_US}")
            return
        if limits.memory_bytes is not None:
            memory = dirs["memory"]
            _write(memory / "memory.limit_in_bytes", limits.memory_bytes)
            if not _write_if_present(memory / "memory.memsw.limit_in_bytes", limits.memory_bytes):
                _write_if_present(memory / "memory.swappiness", 0)  # no swap accounting: keep the job out of swap
            _write_if_present(memory / "memory.oom_control", 0)  # the OOM killer on, whatever the parent says
        if limits.max_processes is not None:
            _write(dirs["pids"] / "pids.max", limits.max_processes)
        if limits.cpus is not None:
            _write(dirs["cpu"] / "cpu.cfs_period_us", CPU_PERIOD_US)
            _write(dirs["cpu"] / "cpu.cfs_quota_us", _cpu_quota(limits.cpus))

    def delegate(self, uid: int, gid: int) -> None:
        """Hand this cgroup to user ``uid``: its folders and their files become that user's, so a process of the user
        started inside (``wrap``) makes its own jobs' cgroups below it, as a worker that is not root does."""
        for path in self.paths:
            for item in (path, *path.iterdir()):
                os.chown(item, uid, gid)

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` behind a ``/bin/sh`` that joins this cgroup and then ``exec``s it: pass the result to
        ``subprocess.Popen`` (``pass_fds`` and ``env`` as for ``argv`` itself). Exit status 125 without running
        ``argv`` when the shell could not join."""
        procs = [str(path / "cgroup.procs") for path in self.paths]
        return ["/bin/sh", "-c", _JOIN_SCRIPT, "opentinker-cgroup", *procs, "--", *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """``subprocess.Popen(self.wrap(argv), **kwargs)``."""
        return subprocess.Popen(self.wrap(argv), **kwargs)

    def pids(self) -> set[int]:
        """Every process in the cgroup now."""
        return set().union(*(_procs(path) for path in self.paths))

    def limit_hit(self) -> str | None:
        """None, or one line naming the limit the attempt ran into: 'memory limit 4 GiB exceeded' (the kernel
        OOM-killed a process), 'process limit 512 exceeded' (a fork or thread was refused)."""
        limits = self.limits
        memory = self.dirs.get("memory")
        if limits.memory_bytes is not None and memory is not None:
            if self.version == 2:
                events = _counters(memory / "memory.events")
                hit = events.get("oom_kill", 0) > 0 or events.get("oom", 0) > 0
            else:
                control = _counters(memory / "memory.oom_control")
                hit = (
                    control["oom_kill"] > 0
                    if "oom_kill" in control
                    else int(_read(memory / "memory.failcnt", "0") or 0) > 0
                )
            if hit:
                return f"memory limit {format_bytes(limits.memory_bytes)} exceeded"
        pids = self.dirs.get("pids")
        if limits.max_processes is not None and pids is not None:
            if _counters(pids / "pids.events").get("max", 0) > 0:
                return f"process limit {limits.max_processes} exceeded"
        return None

    def kill(self, timeout: float = 10.0) -> bool:
        """SIGKILL every process in the cgroup until it is empty (forks racing the kill are caught on the next pass);
        False when some process was still there after ``timeout`` seconds (stuck in the kernel)."""
        if self.version == 2:
            _write_if_present(self.paths[0] / "cgroup.kill", 1)
        for path in self.paths:
            if not _kill_all(path, timeout):
                log.warning("cgroup %s: processes %s survived SIGKILL for %gs", path, sorted(_procs(path)), timeout)
                return False
        return True

    def close(self, timeout: float = 10.0) -> bool:
        """Kill what is left and remove the cgroup's folders (and ``opentinker/`` when no other job uses it); False
        when a folder stayed (a process would not die); the next ``create`` of this name retries.

        Reap the ``Popen`` first (``proc.wait()`` after ``kill()``): a killed child that its parent has not waited
        for keeps a v1 memory cgroup busy, and ``close`` then waits ``timeout`` seconds in vain."""
        removed = True
        for path in self.paths:
            if path.exists() and not _remove_tree(path, timeout):
                log.warning(
                    "cgroup %s could not be removed: processes %s remain, or a killed child was not waited for",
                    path,
                    sorted(_procs(path)),
                )
                removed = False
            with contextlib.suppress(OSError):  # busy (another job's cgroup) or gone: fine
                path.parent.rmdir()
        return removed

    def __enter__(self) -> JobCgroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"JobCgroup({self.name!r}, v{self.version}, {self.limits.describe()})"


# --- files ------------------------------------------------------------------------------------------------------------


def _cpu_quota(cpus: float) -> int:
    return max(1000, round(cpus * CPU_PERIOD_US))


def _make(path: Path, enable: Sequence[str] = ()) -> None:
    """mkdir ``path`` and its parent; on v2 the controllers ``enable`` are first delegated down to ``path``."""
    for _ in range(5):  # another job's close may remove opentinker/ between our two mkdirs
        try:
            _delegate(path.parent.parent, enable)
            path.parent.mkdir(exist_ok=True)
            _delegate(path.parent, enable)
            path.mkdir()
            return
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise CgroupUnavailable(f"cannot make the cgroup {path}: {exc.strerror}") from None
    raise CgroupError(f"cannot make the cgroup {path}: its parent keeps disappearing")


def _delegate(folder: Path, controllers: Sequence[str]) -> None:
    """Enable ``controllers`` for the children of the v2 cgroup ``folder`` (those not enabled yet)."""
    if not controllers:
        return
    enabled = set(_read(folder / "cgroup.subtree_control", "").split())
    for name in controllers:
        if name in enabled:
            continue
        try:
            try:
                _enable(folder, name)
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                _move_into_leaf(folder)
                _enable(folder, name)
        except OSError as exc:
            hint = (
                f" (its processes could not all move into {LEAF}: start the worker in a cgroup delegated to it, "
                "e.g. under systemd-run -p Delegate=yes)"
                if exc.errno == errno.EBUSY
                else ""
            )
            raise CgroupUnavailable(f"cannot enable the {name} controller in {folder}: {exc.strerror}{hint}") from None


def _enable(folder: Path, controller: str) -> None:
    with open(folder / "cgroup.subtree_control", "w") as out:
        out.write(f"+{controller}\n")


def _move_into_leaf(folder: Path) -> None:
    """Move every process of the v2 cgroup ``folder`` (the worker, and whatever else its container or service runs
    there) into ``folder/LEAF``, as container runtimes do for their init, so ``folder`` may enable controllers."""
    leaf = folder / LEAF
    leaf.mkdir(exist_ok=True)
    for pid in _read(folder / "cgroup.procs", "").split():
        with contextlib.suppress(ProcessLookupError), open(leaf / "cgroup.procs", "w") as out:
            out.write(f"{pid}\n")  # one per write(2), as the kernel wants; ESRCH: it exited meanwhile


def _write(path: Path, value: object) -> None:
    try:
        with open(path, "w") as out:
            out.write(f"{value}\n")
    except OSError as exc:
        raise CgroupError(f"cannot write {value!r} to {path}: {exc.strerror}") from None


def _write_if_present(path: Path, value: object) -> bool:
    if not path.exists():
        return False
    _write(path, value)
    return True


def _read(path: Path, default: str) -> str:
    try:
        return path.read_text()
    except OSError:
        return default


def _counters(path: Path) -> dict[str, int]:
    """A flat-keyed cgroup file ('oom_kill 1', 'max 3') as a dict."""
    counters = {}
    for line in _read(path, "").splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            counters[key] = int(value)
    return counters


def _procs(top: Path) -> set[int]:
    """The processes in ``top`` and every cgroup below it."""
    found: set[int] = set()
    for folder, _, _ in os.walk(top):
        found.update(int(pid) for pid in _read(Path(folder) / "cgroup.procs", "").split())
    return found


def _kill_all(top: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        pids = _procs(top)
        if not pids:
            return True
        if time.monotonic() > deadline:
            return False
        # Hold each process by a pidfd, then signal only those still listed: a pid that exited and was reused by a
        # process outside the cgroup between the two reads is never signalled.
        handles = {}
        for pid in pids:
            try:
                handles[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                continue  # gone already
            except OSError:  # no pidfds (a kernel before 5.3): signal by pid
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        try:
            still = _procs(top)
            for pid, handle in handles.items():
                if pid in still:
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(handle, signal.SIGKILL)
        finally:
            for handle in handles.values():
                os.close(handle)
        time.sleep(0.01)


def _remove_tree(top: Path, timeout: float) -> bool:
    """Kill everything in ``top`` and remove it with every cgroup below it (deepest first)."""
    deadline = time.monotonic() + timeout
    while True:
        if not _kill_all(top, max(0.0, deadline - time.monotonic())):
            return False
        try:
            for folder, _, _ in sorted(os.walk(top), key=lambda entry: -len(Path(entry[0]).parts)):
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(folder)
            return True
        except OSError as exc:
            # EBUSY: a process joined after the kill, or the last one is still being released: kill and try again.
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                return False
            time.sleep(0.02)
