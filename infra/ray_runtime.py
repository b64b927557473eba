"""Connect to Ray exactly once per process, where the settings say.

Starting a *local* node is retried: Ray gives its dashboard agent a hard-coded 15 s and the raylet 30 s
to register (ray-project/ray#65983), which a busy 2-core machine sometimes misses although a second
attempt succeeds. Start-up is the one Ray failure that Ray's own retries (actor restarts, task retries)
cannot cover, so it is retried here, after stopping what the failed attempt left running.
"""
from __future__ import annotations

import os
import time

from opentinker.infra.settings import get_settings

START_ATTEMPTS = 3


def ensure_ray() -> None:
    """Start local Ray (all cores, no dashboard) or join ``ray_address``; a no-op when already connected."""
    import ray

    if ray.is_initialized():
        return
    settings = get_settings()
    address = settings.ray_address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
        return
    for attempt in range(1, START_ATTEMPTS + 1):
        before, started = _children(), time.time()
        try:
            ray.init(num_cpus=settings.ray_num_cpus, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
            return
        except Exception as exc:  # ray raises a bare Exception for a node start-up timeout
            if "timed out during startup" not in str(exc) or attempt == START_ATTEMPTS:
                raise
            ray.shutdown()
            _stop([p for p in _children() if p.pid not in {b.pid for b in before}] + _orphaned_agents(started))
            time.sleep(2.0 * attempt)


def _children() -> list:
    import psutil

    return psutil.Process(os.getpid()).children(recursive=True)


def _orphaned_agents(since: float) -> list:
    """Agents whose raylet died are re-parented to init; ours hold files in a session dir named after our pid."""
    import psutil

    marker = f"_{os.getpid()}/"
    found = []
    for process in psutil.process_iter(["ppid", "create_time"]):
        try:
            if process.info["ppid"] != 1 or process.info["create_time"] < since - 1:
                continue
            if any(marker in f.path and "/ray/session_" in f.path for f in process.open_files()):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _stop(processes: list) -> None:
    """Terminate, wait, then kill what is left of a half-started node."""
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
