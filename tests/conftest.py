"""Test-session wiring: every test runs against an isolated data dir; heavy services start once per session.

Fixture modules live in tests/fixtures/ (one per area), registered here as plugins (``pytest_plugins``); tests import
helpers (not fixtures) from them by name.
"""

from __future__ import annotations

import os
import tempfile

# Isolate state before anything reads settings.
_SESSION_DIR = tempfile.mkdtemp(prefix="opentinker-tests-")
os.environ.setdefault("OPENTINKER_DATA_DIR", os.path.join(_SESSION_DIR, "data"))
os.environ.setdefault("PREFECT_HOME", os.path.join(_SESSION_DIR, "prefect"))
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# No warm processes per data dir (~0.6 GB, kept 10 min) behind the suite's many data dirs: each command and training
# child starts fresh. tests/test_training_process.py and tests/test_local_prefect.py turn them on where they are the
# subject.
os.environ.setdefault("OPENTINKER_WARM_PROCESS_IDLE_S", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from opentinker.tasks import prefect_defaults  # noqa: E402

prefect_defaults()  # the test session starts flows
pytest_plugins = [
    "fixtures.federated",
    "fixtures.llm",
    "fixtures.pipeline",
    "fixtures.production",
    "fixtures.ray",
    "fixtures.server",
    "fixtures.serving",
    "fixtures.stack",
    "fixtures.tinker",
]


def pytest_sessionfinish(session, exitstatus):
    """Send the flow runs' last logs, then stop Prefect's temporary API server (the session's first flow started it),
    quietly, while pytest still owns the output streams: left to its exit hook, it logs "Stopping temporary server"
    to a stream pytest has closed (a logging traceback after the summary), and logs still queued find it gone."""
    import logging
    import sys

    if "prefect.server.api.server" in sys.modules:
        from prefect.logging.handlers import APILogHandler
        from prefect.server.api.server import SubprocessASGIServer

        APILogHandler().flush()
        logging.getLogger("prefect").setLevel(logging.WARNING)
        SubprocessASGIServer().stop()
    from opentinker.infra.local_prefect import stop_local_prefect

    stop_local_prefect()  # the session data dir's own, if a test ran `opentinker train` (run_train_flow) in it
