"""Ray start-up that survives a loaded machine.

A local Ray node gives its dashboard/metrics agent a hard-coded 15 s to start and the raylet 30 s to
register (ray-project/ray#65983); on a busy 2-core machine that sometimes fails although a second
attempt succeeds. Start-up is the one Ray failure that Ray's own retries (actor restarts, task
retries) cannot cover, so it is retried here, after stopping what the failed attempt left running.
"""
from __future__ import annotations

import os
import time

START_ATTEMPTS = 3


def connect_ray() -> None:
    """``ensure_ray()`` with up to ``START_ATTEMPTS`` tries when the local node times out starting."""
    import psutil
    import ray

    from opentinker.infra.ray_runtime import ensure_ray

    me = psutil.Process(os.getpid())
    for attempt in range(1, START_ATTEMPTS + 1):
        before, started = {child.pid for child in me.children(recursive=True)}, time.time()
        try:
            ensure_ray()
            return
        except Exception as exc:  # ray raises a bare Exception for a node start-up timeout
            if "timed out during startup" not in str(exc) or attempt == START_ATTEMPTS:
                raise
            ray.shutdown()
            spawned = [child for child in me.children(recursive=True) if child.pid not in before]
            _stop(spawned + _orphaned_agents(started))
            time.sleep(2.0 * attempt)


def _orphaned_agents(since: float) -> list:
    """Agents whose raylet died are re-parented to init; ours hold files in a session dir named after our pid."""
    import psutil

    marker = f"_{os.getpid()}/"
    found = []
    for process in psutil.process_iter(["ppid", "create_time", "name"]):
        try:
            if process.info["ppid"] != 1 or process.info["create_time"] < since - 1:
                continue
            if any(marker in f.path and "/ray/session_" in f.path for f in process.open_files()):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _stop(processes: list) -> None:
    """The half-started node's processes (gcs_server, agents): children this attempt spawned."""
    import psutil

    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=10)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
