"""Connect to Ray exactly once per process, where the settings say."""
from __future__ import annotations

import os

from opentinker.infra.settings import get_settings


def ensure_ray() -> None:
    """Start local Ray (all cores, no dashboard) or join ``ray_address``; a no-op when already connected."""
    import ray

    if ray.is_initialized():
        return
    settings = get_settings()
    address = settings.ray_address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    else:
        ray.init(num_cpus=settings.ray_num_cpus, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
