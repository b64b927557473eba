"""`opentinker server up` adopts the embedded services a killed `up` left running, and only those started with the
same settings: a restart with another Prefect database or on another address is refused in one line, not served by
the old stack."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from opentinker.infra.processes import ServiceError, spawn
from opentinker.infra.recorded import RecordedServices


@pytest.fixture
def services(tmp_path):
    services = RecordedServices(tmp_path)
    yield services
    services.stop_all()


def _sleeper(log):
    return spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], log, url="", ports={})


def test_a_running_service_is_adopted_with_the_same_settings(services):
    first = services.ensure("prefect", _sleeper, {"database": "sqlite"})
    again = services.ensure("prefect", _sleeper, {"database": "sqlite"})
    assert again.pid == first.pid and again.alive()


def test_a_running_service_started_with_other_settings_is_refused_naming_them(services):
    first = services.ensure("worker", _sleeper, {"server": "http://127.0.0.1:8600"})
    with pytest.raises(ServiceError) as refused:
        services.ensure("worker", _sleeper, {"server": "http://127.0.0.1:8700"})
    message = str(refused.value)
    assert f"pid {first.pid}" in message
    assert "server 'http://127.0.0.1:8600' (now 'http://127.0.0.1:8700')" in message
    assert "opentinker server down" in message
    assert first.alive()  # refused, not replaced: a job it runs goes on


def test_a_dead_service_is_started_again_with_the_new_settings(services):
    first = services.ensure("prefect", _sleeper, {"database": "sqlite"})
    first.stop()
    second = services.ensure("prefect", _sleeper, {"database": "postgres"})
    assert second.pid != first.pid and second.alive()
    assert services.adopt("prefect", {"database": "postgres"}).pid == second.pid
    assert services.stop_all() == ["prefect"]


def test_a_topology_whose_worker_has_its_own_tmp_refuses_a_root_under_tmp_before_starting_anything(tmp_path):
    """The worker user's ``/tmp`` is its own: a root there would fail its first job, long after ``up`` returned."""
    from opentinker.server.topology import Topology

    root = Path("/tmp") / f"opentinker-topology-{tmp_path.name}"
    with pytest.raises(ServiceError, match=r"root: .* lies under /tmp.*put the topology's root elsewhere"):
        Topology.up(root, worker_user="nobody")
    assert not root.exists()
