"""Test-session wiring: every test runs against an isolated data dir; heavy services start once per session.

Fixture modules live in tests/fixtures/ (one per area) and are star-imported here.
"""

from __future__ import annotations

import os
import tempfile

# Isolate state before anything reads settings.
_SESSION_DIR = tempfile.mkdtemp(prefix="opentinker-tests-")
os.environ.setdefault("OPENTINKER_DATA_DIR", os.path.join(_SESSION_DIR, "data"))
os.environ.setdefault("PREFECT_HOME", os.path.join(_SESSION_DIR, "prefect"))
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from opentinker.tasks import prefect_defaults  # noqa: E402

prefect_defaults()  # the test session starts flows
from fixtures.federated import *  # noqa: F403, E402
from fixtures.llm import *  # noqa: F403, E402
from fixtures.pipeline import *  # noqa: F403, E402
from fixtures.ray import *  # noqa: F403, E402
from fixtures.server import *  # noqa: F403, E402
from fixtures.serving import *  # noqa: F403, E402
from fixtures.stack import *  # noqa: F403, E402
