"""Worker death mid-run: Ray restarts the rollout actor and replays its seeded rollout; the flow completes
and the trained weights equal those of an uninterrupted run with the same seed."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import numpy as np
import pytest
from fixtures.pipeline import small_train_params

from opentinker.infra.settings import get_settings

pytestmark = pytest.mark.slow


def _weights(run_name: str) -> dict[str, np.ndarray]:
    from opentinker.tasks.train import run_dir

    with np.load(run_dir(get_settings().resolved_data_dir, run_name) / "export" / "weights.npz") as data:
        return dict(data)


def test_killing_a_rollout_actor_mid_run_changes_nothing():
    from opentinker.flows.train import train_flow
    from opentinker.tasks.train import run_dir
    from opentinker.tracking import progress

    params = small_train_params(seed=7, steps=3072, model_name="test-faults", eval_episodes=2)
    reference = train_flow(params.model_copy(update={"run_name": "faults-reference"}))

    victim_params = params.model_copy(update={"run_name": "faults-killed"})
    workers_file = run_dir(get_settings().resolved_data_dir, victim_params.resolved_run_name) / "workers.json"
    workers_file.unlink(missing_ok=True)
    killed: list[int] = []

    def kill_during_next_collect(step: int, total: int, metrics: dict) -> None:
        if killed or step < 1024 or not workers_file.exists():
            return
        pid = json.loads(workers_file.read_text())["pids"][0]
        killed.append(pid)
        threading.Timer(0.02, os.kill, (pid, signal.SIGKILL)).start()

    progress.add_listener(kill_during_next_collect)
    try:
        result = train_flow(victim_params)
    finally:
        progress.remove_listener(kill_during_next_collect)

    assert killed, "the rollout actor was never killed"
    time.sleep(0.5)
    assert not _alive(killed[0])
    assert result.global_step == reference.global_step
    expected, actual = _weights("faults-reference"), _weights("faults-killed")
    assert expected.keys() == actual.keys()
    for key in expected:
        np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)
    assert result.eval_mean == reference.eval_mean


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
