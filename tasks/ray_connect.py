"""Ray start-up that survives a loaded machine.

Ray gives a local raylet a fixed 30 s to register with the GCS; on a busy 2-core machine that
sometimes fails although a second attempt succeeds. Start-up is the one Ray failure that Ray's own
retries (actor restarts, task retries) cannot cover, so it is retried here, after cleaning up.
"""
from __future__ import annotations

import time

START_ATTEMPTS = 3


def connect_ray() -> None:
    """``ensure_ray()`` with up to ``START_ATTEMPTS`` tries when the local node times out starting."""
    import ray

    from opentinker.infra.ray_runtime import ensure_ray

    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            ensure_ray()
            return
        except Exception as exc:  # ray raises a bare Exception for a node start-up timeout
            if "timed out during startup" not in str(exc) or attempt == START_ATTEMPTS:
                raise
            ray.shutdown()
            time.sleep(2.0 * attempt)
