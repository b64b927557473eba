"""Prefect tasks: one logical, retriable step each (rollout, train, evaluate, package, upload).

Importing this package sets safe Prefect defaults before anything imports prefect: the ephemeral
API server needs far longer than Prefect's 20 s default to start on a busy 2-core machine.
"""

import os

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no phoning home (and no telemetry errors offline)
# Prefect 3.7 keeps results (and cache records) in ~/.prefect/storage even when PREFECT_HOME points elsewhere.
os.environ.setdefault(
    "PREFECT_RESULTS_LOCAL_STORAGE_PATH",
    os.path.join(os.path.expanduser(os.environ.get("PREFECT_HOME", "~/.prefect")), "storage"),
)
