"""The one process kit (``infra.processes``) and the one atomic writer (``infra.files``), on real processes."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
import time

import psutil
import pytest

from opentinker.federated import deploy
from opentinker.infra.files import atomic_write
from opentinker.infra.processes import ServiceError, ServiceProcess, spawn, start

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_federation_down_spares_a_stranger_holding_a_recorded_pid(tmp_path):
    """Flower processes are known by pid *and* start time: a pid reused by anyone else is never signalled."""
    stranger = subprocess.Popen(SLEEPER, start_new_session=True)
    try:
        started = psutil.Process(stranger.pid).create_time()
        gone = dict(pid=stranger.pid, create_time=started - 100, url="", log=str(tmp_path / "x.log"))
        fed = deploy.Federation(root=str(tmp_path), port=1, certs=str(tmp_path))
        fed.superlink = ServiceProcess(name="flower-superlink", **gone)
        fed.sites["0"] = ServiceProcess(name="site 0", **gone)
        fed.save()
        deploy.down(tmp_path)
        assert stranger.poll() is None, "a recycled pid must not be killed"
        assert deploy.Federation.load(tmp_path).sites == {}
    finally:
        stranger.kill()
        stranger.wait()


def test_a_stepped_wall_clock_leaves_a_live_service_alive_and_a_recycled_pid_dead(tmp_path):
    """Start times are compared as offsets from boot: a clock step moves psutil's start times and boot time alike (a
    20 s step on the development VM made `server up` think its worker dead and start two more)."""
    service = spawn("sleeper", SLEEPER, tmp_path / "sleeper.log", url="", ports={})
    try:
        stepped = dataclasses.replace(
            service, create_time=service.create_time + 20, boot_time=service.boot_time + 20, popen=None
        )
        assert ServiceProcess.from_dict(stepped.to_dict()).alive()
        recycled = dataclasses.replace(service, create_time=service.create_time - 20, popen=None)
        assert not recycled.alive()
    finally:
        service.stop()


def test_stop_ends_the_whole_group_even_when_a_member_ignores_sigterm(tmp_path):
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"subprocess.Popen({SLEEPER!r})\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n"
    )
    service = start(
        "stubborn", [sys.executable, "-c", script], tmp_path / "s.log", ready="up", what="it said up", timeout=60
    )
    family = service.family()
    assert len(family) == 2
    service.stop(timeout=1)
    assert not any(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE for proc in family)
    assert not service.alive()


def test_start_reports_exit_code_and_only_this_starts_log(tmp_path):
    log = tmp_path / "s.log"
    log.write_text("ready from an earlier start\n")
    with pytest.raises(ServiceError, match=r"(?s)dies exited before .*exited with code 3.*Last lines of .*boom") as err:
        start(
            "dies",
            [sys.executable, "-c", "print('boom', flush=True); raise SystemExit(3)"],
            log,
            ready="ready",
            what="it said ready",
            timeout=60,
        )
    assert err.value.service is not None and "earlier" not in err.value.service.log_text()


def test_start_fails_fast_on_a_failure_line_and_stops_the_process(tmp_path):
    script = "import time; print('Application startup failed', flush=True); time.sleep(60)"
    began = time.monotonic()
    with pytest.raises(ServiceError, match="failed to start") as err:
        start(
            "bento",
            [sys.executable, "-c", script],
            tmp_path / "b.log",
            ready=lambda: False,
            what="never",
            timeout=60,
            fails_on="Application startup failed",
        )
    assert time.monotonic() - began < 30
    assert not err.value.service.alive()


def test_atomic_write_modes_and_payload_kinds(tmp_path):
    key = atomic_write(tmp_path / "deep" / "key", "s3cret", mode=0o600)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and key.read_text() == "s3cret"
    public = atomic_write(tmp_path / "cert", b"pem", mode=0o644)
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    umask = os.umask(0o022)
    try:
        plain = atomic_write(tmp_path / "state.json", lambda handle: handle.write(b"{}"))
    finally:
        os.umask(umask)
    assert stat.S_IMODE(plain.stat().st_mode) == 0o644 and json.loads(plain.read_text()) == {}
    atomic_write(key, "rotated", mode=0o600)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and key.read_text() == "rotated"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cert", "deep", "state.json"]


def test_a_writer_that_fails_or_a_process_killed_mid_write_leaves_the_old_file(tmp_path):
    path = atomic_write(tmp_path / "checkpoint.pt", b"old", mode=0o600)

    def half_then_fail(handle):
        handle.write(b"ne")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, half_then_fail)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]

    crash = (
        "import os, signal, sys\n"
        "from opentinker.infra.files import atomic_write\n"
        "def half(handle):\n"
        "    handle.write(b'ne'); handle.flush(); os.kill(os.getpid(), signal.SIGKILL)\n"
        "atomic_write(sys.argv[1], half)\n"
    )
    done = subprocess.run([sys.executable, "-c", crash, str(path)], check=False)
    assert done.returncode == -9
    assert path.read_bytes() == b"old" and stat.S_IMODE(path.stat().st_mode) == 0o600
