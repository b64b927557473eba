"""The Prefect server ``opentinker train`` runs its flow runs on when no Prefect API is configured: one per data dir,
started by the first run and adopted by every later one, until ``opentinker down`` stops it.

Why: with no API configured every flow process starts Prefect's temporary server of its own (a fresh interpreter
importing Prefect's server, its database migrations checked, uvicorn up: 8–10 s on a loaded 2-core machine) and
stops it again at exit, so each small run paid that start. A server kept per data dir is paid for once. It is
recorded like ``opentinker server up``'s embedded services (pid and start time, ``<data_dir>/prefect/
services.json``): a recorded server that still runs and answers is adopted, a dead or hung one is replaced. Its state
(``PREFECT_HOME``: SQLite database, UI build) lives in ``<data_dir>/prefect/home``, so the runs of a data dir keep
one history, which its UI shows.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

from opentinker.infra.processes import ServiceProcess, http_ok
from opentinker.infra.recorded import RecordedServices
from opentinker.infra.services import DEFAULT_TIMEOUT_S, start_prefect
from opentinker.infra.settings import Settings, get_settings

NAME = "prefect"


def local_prefect_dir(settings: Settings | None = None) -> Path:
    """Where the data dir's server is recorded (``services.json``), logs (``logs/``) and keeps its state (``home/``)."""
    return (settings or get_settings()).resolved_data_dir / "prefect"


def ensure_local_prefect(settings: Settings | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> ServiceProcess:
    """The data dir's running Prefect server: adopted when recorded, alive and answering, else started and recorded.
    One caller at a time per data dir (a file lock), so two runs starting together share one server."""
    root = local_prefect_dir(settings)
    services = RecordedServices(root)
    with _locked(root):
        service = services.adopt(NAME)
        if service is not None and not http_ok(f"{service.url}/api/health", timeout=10.0):
            services.stop_all()  # alive but not answering: a hung server serves no run
            service = None
        if service is None:
            service = services.ensure(NAME, lambda log: start_prefect(root / "home", log, timeout=timeout))
    return service


def running_local_prefect(settings: Settings | None = None) -> ServiceProcess | None:
    """The data dir's recorded server if it still runs (nothing is started)."""
    root = local_prefect_dir(settings)
    return RecordedServices(root).adopt(NAME) if root.exists() else None


def stop_local_prefect(settings: Settings | None = None) -> list[str]:
    """Stop the data dir's server, if one runs (``opentinker down``); the names of what was stopped."""
    root = local_prefect_dir(settings)
    if not root.exists():
        return []
    with _locked(root):
        return RecordedServices(root).stop_all()


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
