"""Prefect tasks: one logical, retriable step each (probe, train, evaluate, register, upload, federated steps).

Importing this package changes nothing; whoever starts a flow calls ``prefect_defaults()`` first (the CLI, the test
session, a bench), so BentoML and Flower processes that import the library keep their own environment.
"""

import os


def prefect_defaults() -> None:
    """Safe Prefect defaults for this process, unless already set; call it before a flow starts.

    The ephemeral API server needs far longer than Prefect's 20 s default to start on a busy 2-core machine; no
    analytics (and no telemetry errors offline); Prefect 3.7 keeps results (and cache records) in ~/.prefect/storage
    even when PREFECT_HOME points elsewhere. Prefect reads its settings once at import, so they are re-read here.
    """
    import sys

    home = os.path.expanduser(os.environ.get("PREFECT_HOME", "~/.prefect"))
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", os.path.join(home, "storage"))
    if "prefect.context" in sys.modules:
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()
