"""Per-job limits through real kernel cgroups (``infra/cgroups.py``): a fork bomb stops at the process limit, a memory
hog is OOM-killed at the memory limit, each named by ``limit_hit()``, while a well-behaved job in a sibling cgroup
finishes untouched; ``kill()`` leaves no process and ``close()`` no folder; the limits hold inside bubblewrap too.

Every bomb is bounded on its own (500 fork attempts, 2 GiB of allocation) so a broken limit cannot take the machine,
and every process a test starts is in a cgroup the test kills at the end, whatever happened.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from opentinker.infra import cgroups
from opentinker.infra.cgroups import (
    CgroupUnavailable,
    GiB,
    JobCgroup,
    JobLimits,
    MiB,
    format_bytes,
    job_cgroup,
    limits_for,
)
from opentinker.infra.settings import Settings

BOMB = """
import os, time
forked = refused = 0
for _ in range(500):
    try:
        pid = os.fork()
    except OSError:
        refused += 1
        continue
    if pid == 0:
        os.close(1)
        os.close(2)
        time.sleep(60)
        os._exit(0)
    forked += 1
print(forked, refused, flush=True)
"""
HOG = """
chunks = []
for _ in range(256):
    chunks.append(b"x" * (8 << 20))
print("survived", len(chunks) * 8, "MiB", flush=True)
"""
GOOD = """
import os
data = b"y" * (32 << 20)
children = []
for i in range(4):
    pid = os.fork()
    if pid == 0:
        os._exit(0 if len(data) == 32 << 20 else 1)
    children.append(pid)
codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
print("done", codes, flush=True)
"""
LIMITS = JobLimits(memory_bytes=256 * MiB, max_processes=64)


@pytest.fixture
def make_cgroup():
    """``make_cgroup(limits)``: a fresh cgroup, killed and removed after the test whatever happened."""
    try:
        cgroups.check_available(LIMITS)
    except CgroupUnavailable as exc:
        pytest.skip(f"no writable cgroup memory and pids controllers on this machine: {exc}")
    made: list[JobCgroup] = []

    def make(limits: JobLimits = LIMITS, name: str | None = None) -> JobCgroup:
        cgroup = JobCgroup.create(name or f"test-{uuid.uuid4().hex[:12]}", limits)
        made.append(cgroup)
        return cgroup

    yield make
    for cgroup in made:
        cgroup.close()


def python(code: str) -> list[str]:
    return [sys.executable, "-I", "-c", code]


def test_a_fork_bomb_stops_at_the_process_limit_and_is_killed_whole(make_cgroup):
    cgroup = make_cgroup()
    done = subprocess.run(cgroup.wrap(python(BOMB)), capture_output=True, text=True, timeout=60, env={})
    forked, refused = map(int, done.stdout.split())
    assert done.returncode == 0, done.stderr
    assert forked < 64 and refused > 0, (forked, refused)
    assert cgroup.limit_hit() == "process limit 64 exceeded"
    assert len(cgroup.pids()) == forked, "the bomb's children sleep on in the cgroup"

    assert cgroup.kill(timeout=10)
    assert cgroup.pids() == set()
    paths = cgroup.paths
    assert cgroup.close()
    assert not any(path.exists() for path in paths)


def test_a_memory_hog_is_oom_killed_at_the_memory_limit(make_cgroup):
    cgroup = make_cgroup()
    done = subprocess.run(cgroup.wrap(python(HOG)), capture_output=True, text=True, timeout=60, env={})
    assert done.returncode == -9, (done.returncode, done.stdout, done.stderr)
    assert "survived" not in done.stdout
    assert cgroup.limit_hit() == "memory limit 256 MiB exceeded"


def test_a_sibling_job_finishes_unharmed_beside_both_bombs(make_cgroup):
    bomb, hog, good = make_cgroup(), make_cgroup(), make_cgroup()
    started = [
        bomb.popen(python(BOMB), stdout=subprocess.PIPE, text=True, env={}),
        hog.popen(python(HOG), stdout=subprocess.PIPE, text=True, env={}),
    ]
    done = subprocess.run(good.wrap(python(GOOD)), capture_output=True, text=True, timeout=60, env={})
    for proc in started:
        proc.communicate(timeout=60)
    assert done.returncode == 0 and done.stdout == "done [0, 0, 0, 0]\n", (done.stdout, done.stderr)
    assert good.limit_hit() is None
    assert bomb.limit_hit() == "process limit 64 exceeded"
    assert hog.limit_hit() == "memory limit 256 MiB exceeded"


def test_the_limits_hold_inside_bubblewrap(make_cgroup):
    from opentinker.infra.bwrap import pipe_with, seccomp_program
    from opentinker.server.sandbox import Sandbox, SandboxUnavailable, check_available

    try:
        check_available()
    except SandboxUnavailable as exc:
        pytest.skip(f"bubblewrap cannot make a sandbox here: {exc}")
    results = {}
    for label, code in (("bomb", BOMB), ("hog", HOG)):
        cgroup = make_cgroup()
        seccomp = pipe_with(seccomp_program())
        try:
            argv = Sandbox(network=False).argv(python(code), seccomp_fd=seccomp)
            proc = cgroup.popen(argv, pass_fds=(seccomp,), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={})
        finally:
            os.close(seccomp)
        out, err = proc.communicate(timeout=60)
        results[label] = (proc.returncode, out.decode(), err.decode(), cgroup.limit_hit())
        assert cgroup.kill(timeout=10) and cgroup.pids() == set()

    returncode, out, err, hit = results["bomb"]
    forked, refused = map(int, out.split())
    assert forked < 64 and refused > 0, (out, err)
    assert hit == "process limit 64 exceeded"
    returncode, out, err, hit = results["hog"]
    assert returncode != 0 and "survived" not in out, (returncode, out, err)
    assert hit == "memory limit 256 MiB exceeded"


def test_a_crashed_workers_cgroup_of_the_same_name_is_replaced(make_cgroup):
    name = f"test-{uuid.uuid4().hex[:12]}"
    stale = make_cgroup(name=name)
    leftover = stale.popen(["/bin/sleep", "60"], env={})  # the worker "crashes": no kill, no close
    # A crashed worker's children are reaped by init; here a thread stands in for it (an unreaped child keeps a v1
    # memory cgroup busy).
    reaper = threading.Thread(target=leftover.wait, daemon=True)
    reaper.start()
    while not stale.pids():
        time.sleep(0.01)
    try:
        fresh = make_cgroup(name=name)
        reaper.join(timeout=10)
        assert leftover.returncode == -9
        assert fresh.paths == stale.paths and fresh.pids() == set()
        assert fresh.limit_hit() is None
    finally:
        leftover.kill()
        leftover.wait()


def test_a_wrapped_command_never_runs_outside_its_cgroup(make_cgroup, tmp_path):
    cgroup = make_cgroup()
    inside = subprocess.run(cgroup.wrap(["/bin/cat", "/proc/self/cgroup"]), capture_output=True, text=True, env={})
    assert inside.returncode == 0
    assert {f"/{cgroups.PARENT}/{cgroup.name}" in line for line in inside.stdout.splitlines() if "memory" in line} == {
        True
    }
    cgroup.close()
    marker = tmp_path / "ran"
    refused = subprocess.run(cgroup.wrap(["/bin/touch", str(marker)]), capture_output=True, text=True, env={})
    assert refused.returncode == cgroups.JOIN_FAILED and not marker.exists()


def test_cpu_and_swap_limits_are_written(make_cgroup):
    try:
        cgroups.check_available(JobLimits(cpus=0.5))
    except CgroupUnavailable as exc:
        pytest.skip(f"no cpu controller: {exc}")
    cgroup = make_cgroup(JobLimits(memory_bytes=256 * MiB, max_processes=64, cpus=0.5))
    if cgroup.version == 2:
        assert (cgroup.dirs["cpu"] / "cpu.max").read_text().split() == ["50000", "100000"]
        assert (cgroup.dirs["memory"] / "memory.max").read_text().strip() == str(256 * MiB)
    else:
        assert (cgroup.dirs["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "50000"
        memory = cgroup.dirs["memory"]
        assert (memory / "memory.limit_in_bytes").read_text().strip() == str(256 * MiB)
        memsw = memory / "memory.memsw.limit_in_bytes"
        assert not memsw.exists() or memsw.read_text().strip() == str(256 * MiB)


# --- without the kernel ----------------------------------------------------------------------------------------------


def test_limits_come_from_the_tenant_then_the_settings(tmp_path):
    from opentinker.server.db import Tenant
    from opentinker.server.schemas import Quotas

    settings = Settings(data_dir=tmp_path, job_max_processes=100, job_cpus=2)
    assert limits_for(Quotas(job_memory_mb=256), settings) == JobLimits(256 * MiB, 100, 2.0)
    assert limits_for(Tenant(name="t", job_max_processes=64, job_cpus=0.5), settings).max_processes == 64
    defaults = limits_for(None, Settings(data_dir=tmp_path))
    assert defaults.max_processes == 512 and defaults.cpus is None
    assert 0 < defaults.memory_bytes <= 8 * GiB and defaults.memory_bytes == cgroups.default_memory_bytes()
    assert limits_for(Quotas(), Settings(data_dir=tmp_path, job_memory_mb=1024)).memory_bytes == GiB


def test_limits_are_checked_and_named_as_people_write_them():
    assert [format_bytes(n) for n in (256 * MiB, 4 * GiB, 5 * GiB + 800 * MiB)] == ["256 MiB", "4 GiB", "5.8 GiB"]
    assert JobLimits(memory_bytes=float(GiB), max_processes=512.0).memory_bytes == GiB  # JSON round trip
    assert JobLimits(GiB, 512, None).describe() == "memory 1 GiB, 512 processes, all CPUs"
    for bad in ({"max_processes": 0}, {"memory_bytes": 1024}, {"cpus": 0.0}, {"max_processes": 1.5}):
        with pytest.raises(ValueError):
            JobLimits(**bad)
    with pytest.raises(ValueError, match="cgroup name"):
        JobCgroup.create("../escape", LIMITS)


def test_no_usable_controller_fails_closed_naming_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(cgroups, "_hierarchies", lambda: [])
    with pytest.raises(CgroupUnavailable, match=r"memory, pids.*OPENTINKER_JOB_LIMITS=none"):
        JobCgroup.create("anything", LIMITS)
    assert not cgroups.available(LIMITS)
    assert job_cgroup("anything", LIMITS, Settings(data_dir=tmp_path, job_limits="none")) is None


def test_cgroup_v2_files_on_a_stand_in_hierarchy(monkeypatch, tmp_path):
    """The v2 path on a folder standing in for a unified hierarchy (these machines bind every controller to v1)."""
    v2 = cgroups._Hierarchy(2, frozenset(("cpu", "memory", "pids")), tmp_path)
    monkeypatch.setattr(cgroups, "_hierarchies", lambda: [v2])
    cgroup = JobCgroup.create("v2-job", JobLimits(memory_bytes=GiB, max_processes=512, cpus=1.5))
    folder = tmp_path / cgroups.PARENT / "v2-job"
    assert cgroup.version == 2 and cgroup.paths == (folder,) and set(cgroup.dirs) == {"cpu", "memory", "pids"}
    assert (folder / "memory.max").read_text() == f"{GiB}\n"
    assert (folder / "pids.max").read_text() == "512\n"
    assert (folder / "cpu.max").read_text() == "150000 100000\n"
    assert cgroup.wrap(["x"])[-3:] == [str(folder / "cgroup.procs"), "--", "x"]
    assert cgroup.limit_hit() is None
    (folder / "pids.events").write_text("max 3\n")
    assert cgroup.limit_hit() == "process limit 512 exceeded"
    (folder / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n")
    assert cgroup.limit_hit() == "memory limit 1 GiB exceeded"


def test_kill_is_bounded_and_leaves_nothing(make_cgroup):
    cgroup = make_cgroup(JobLimits(max_processes=64))
    procs = [cgroup.popen(["/bin/sleep", "60"], env={}) for _ in range(3)]
    deadline = time.monotonic() + 10
    while len(cgroup.pids()) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    assert cgroup.kill(timeout=5)
    assert time.monotonic() - started < 5
    assert [proc.wait(timeout=5) for proc in procs] == [-9, -9, -9]
    paths = cgroup.paths
    assert cgroup.close() and not any(Path(path).exists() for path in paths)


def test_tenant_job_limits_are_set_by_the_cli_and_the_api(tmp_path, monkeypatch):
    """``opentinker server tenants set --job-*`` and ``PATCH /v1/tenants/{name}`` set a tenant's job limits; null
    gives a limit back to the server's default; ``limits_for`` reads the row."""
    from starlette.testclient import TestClient
    from typer.testing import CliRunner

    from opentinker.cli import app as cli
    from opentinker.infra.settings import get_settings
    from opentinker.server.app import create_app
    from opentinker.server.db import Store, Tenant
    from opentinker.server.keys import KeyRing

    monkeypatch.setenv("OPENTINKER_DATA_DIR", str(tmp_path))
    get_settings.cache_clear()
    try:
        settings = get_settings()
        store = Store(settings.server_database)  # the server's database, as `server up` makes it
        done = CliRunner().invoke(
            cli, ["server", "tenants", "set", "lab", "--job-memory-mb", "512", "--job-max-processes", "64"]
        )
        assert done.exit_code == 0, done.output
        assert "memory/job 512 MiB, processes/job 64, CPUs/job default" in done.output
        _, admin = KeyRing(store).create("ops", ["admin"])
        with TestClient(create_app(settings, jobs=False)) as client:
            url, headers = "/v1/tenants/lab", {"Authorization": f"Bearer {admin}"}
            assert client.get(url, headers=headers).json()["job_memory_mb"] == 512
            body = client.patch(url, headers=headers, json={"job_cpus": 1.5, "job_memory_mb": None}).json()
            assert (body["job_memory_mb"], body["job_max_processes"], body["job_cpus"]) == (None, 64, 1.5)
            assert client.patch(url, headers=headers, json={"job_max_processes": 0}).status_code == 422
        with store.session() as session:
            limits = limits_for(session.get(Tenant, "lab"), settings)
        assert limits == JobLimits(cgroups.default_memory_bytes(), 64, 1.5)
        store.close()
    finally:
        get_settings.cache_clear()


def _unified_root() -> Path | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[fields.index("-") + 1] == "cgroup2":
            return Path(fields[4])
    return None


def test_a_v2_cgroup_holding_the_worker_moves_it_into_a_leaf_to_delegate_controllers():
    """The real kernel's v2 rule: the worker's own cgroup holds the worker (and a neighbour process), so it may not
    enable a controller for its jobs until both moved into its leaf; the worker's base stays the cgroup above it.
    (On these machines the unified hierarchy has only ``hugetlb``: the rule is the same for every controller.)"""
    root = _unified_root()
    if root is None or os.geteuid() != 0:
        pytest.skip("needs root and a mounted cgroup2 hierarchy")
    controller = next(iter(sorted(set(cgroups._read(root / "cgroup.controllers", "").split()))), None)
    if controller is None:
        pytest.skip("the cgroup2 hierarchy offers no controller here")
    enabled_before = controller in cgroups._read(root / "cgroup.subtree_control", "").split()
    (root / "cgroup.subtree_control").write_text(f"+{controller}\n")
    own = root / f"ot-leaf-test-{uuid.uuid4().hex[:8]}"
    own.mkdir()
    join = f'echo $$ > {own}/cgroup.procs && exec "$@"'
    neighbour = subprocess.Popen(["/bin/sh", "-c", join, "sh", "sleep", "60"])
    worker_code = f"""
from pathlib import Path
from opentinker.infra import cgroups
before = next(h.base for h in cgroups._hierarchies() if h.version == 2)
cgroups._make(before / cgroups.PARENT / "job-1", enable=[{controller!r}])
after = next(h.base for h in cgroups._hierarchies() if h.version == 2)
print(before, after, Path("/proc/self/cgroup").read_text().splitlines()[-1], sep="|")
"""
    try:
        out = subprocess.run(
            ["/bin/sh", "-c", join, "sh", sys.executable, "-c", worker_code], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        before, after, own_line = out.stdout.strip().split("|")
        assert Path(before) == own and Path(after) == own  # the leaf is not a new base: no leaf inside a leaf
        assert own_line.endswith(f"/{own.name}/{cgroups.LEAF}")
        assert controller in cgroups._read(own / "cgroup.subtree_control", "").split()
        assert controller in cgroups._read(own / cgroups.PARENT / "job-1" / "cgroup.controllers", "").split()
        assert cgroups._read(own / "cgroup.procs", "x").split() == []
        assert str(neighbour.pid) in cgroups._read(own / cgroups.LEAF / "cgroup.procs", "").split()
    finally:
        neighbour.kill()
        neighbour.wait()
        assert cgroups._remove_tree(own, timeout=10.0)
        if not enabled_before:
            (root / "cgroup.subtree_control").write_text(f"-{controller}\n")
