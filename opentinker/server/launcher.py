"""``opentinker server up|down|worker``: the API in the foreground, with the embedded stack behind it.

With nothing configured ``up`` starts what the jobs need on this machine: a Prefect server (unless
``prefect_api_url`` names one) and one worker of the server's pool. Their pids are recorded in
``<data_dir>/server/services.json``: a server that was killed finds them still running and adopts them (a job that
was running keeps running), and ``down`` stops them. The worker gets a key with the ``worker`` scope, kept in
``<data_dir>/server/worker.key`` (mode 0600), and an environment with nothing of the server's but Prefect's URL.
The same code runs against a Prefect server with workers on many machines (``opentinker server worker``),
PostgreSQL (``server_database_url``) and a Ray cluster (``ray_address``), configured instead of started; with
``server_prefect_database = postgres`` the embedded Prefect keeps its state in an embedded PostgreSQL.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from opentinker.infra.files import atomic_write
from opentinker.infra.processes import ServiceProcess, free_ports, spawn, start_http, venv_bin
from opentinker.infra.recorded import RecordedServices
from opentinker.infra.settings import Settings, get_settings

from .orchestration import WORKER_QUERY_SECONDS

WATCH_S = 2.0
"""How often ``up`` checks that its worker still runs."""
WORKER_ENV = (
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "TMPDIR",
    "OPENTINKER_SANDBOX",
    "OPENTINKER_SERVER_JOB_NICE",
    "OPENTINKER_JOB_LIMITS",
)
"""What the worker inherits from ``server up``'s environment (no keys, no database URL, no store credentials)."""


def server_dir(settings: Settings) -> Path:
    return settings.resolved_data_dir / "server"


def serve(
    host: str,
    port: int,
    jobs: bool = True,
    worker: bool = True,
    on_ready: Callable[[str, str], None] | None = None,
    settings: Settings | None = None,
) -> None:
    """Serve the API on ``host:port`` until interrupted; with ``jobs`` also the embedded Prefect server and worker
    (started, or adopted when a killed ``up`` left them running), stopped again when the API stops.
    ``on_ready(url, prefect_url)`` once it answers; ``settings`` default ``get_settings()``."""
    import uvicorn

    from .app import create_app

    settings = settings or get_settings()
    url = f"http://{host}:{port}"
    services = RecordedServices(server_dir(settings))
    if jobs and not settings.prefect_api_url:
        prefect_config = {"database": settings.server_prefect_database}
        services.adopt("prefect", prefect_config)  # one on another database is refused before anything starts
        prefect_settings = dict(PREFECT_SETTINGS)
        if settings.server_prefect_database == "postgres":
            prefect_settings["PREFECT_API_DATABASE_CONNECTION_URL"] = _postgres(services, server_dir(settings))
        start = lambda log: _start_prefect(server_dir(settings), log, prefect_settings)  # noqa: E731
        prefect = services.ensure("prefect", start, prefect_config)
        capacity = settings.server_pool_limit or embedded_pool_limit()
        settings = settings.model_copy(update={"prefect_api_url": f"{prefect.url}/api", "server_pool_limit": capacity})
    app = create_app(settings, jobs=jobs)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="on")
    server = uvicorn.Server(config)

    stop = threading.Event()
    worker_config = {"server": url, "prefect_api_url": settings.prefect_api_url}
    if jobs and worker:
        services.adopt("worker", worker_config)  # a worker of another address is refused before the API listens

    def ready() -> None:
        if jobs and worker:
            key_file = _worker_key(settings)
            start = lambda log: start_worker(log, url, key_file, settings.prefect_api_url)  # noqa: E731
            services.ensure("worker", start, worker_config)
            watch = (services, "worker", start, worker_config, stop)
            threading.Thread(target=_keep_up, args=watch, daemon=True).start()
        if on_ready is not None:
            on_ready(url, settings.prefect_api_url.removesuffix("/api"))

    def shut_down() -> None:
        stop.set()
        stop_services(settings, api_stopping=True)

    _around_uvicorn(server, after_startup=ready, after_shutdown=shut_down)
    server.run()


def _keep_up(
    services: RecordedServices,
    name: str,
    start: Callable[[Path], ServiceProcess],
    config: Mapping[str, str],
    stop: threading.Event,
) -> None:
    """Start the service again whenever it has died (a Prefect worker exits after repeated API errors)."""
    while not stop.wait(WATCH_S):
        services.ensure(name, start, config)


def stop_services(settings: Settings | None = None, api_stopping: bool = False) -> list[str]:
    """Stop what ``up`` started and recorded: the embedded worker and Prefect server, the local Ray of the Tinker
    engine, and the policy services it started for tenants (``opentinker server down``, or ``up`` itself when it
    stops: ``api_stopping``, then the local Ray only if this process started it, as other APIs on the data dir may
    be using its engine)."""
    from .db import Store
    from .models import Services
    from .tinker.remote import stop_local_ray

    settings = settings or get_settings()
    store = Store(settings.server_database)
    try:
        policies = Services(store, settings).stop_all()
    finally:
        store.close()
    embedded = RecordedServices(server_dir(settings)).stop_all()
    return [
        *(f"policy service {name}" for name in policies),
        *embedded,
        *stop_local_ray(settings, started_here=api_stopping),
    ]


def start_worker(
    log: Path,
    server_url: str,
    key_file: Path,
    prefect_api_url: str,
    prefix: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
) -> ServiceProcess:
    """``opentinker server worker`` as a background process with a curated environment; ``prefix`` goes before the
    command (another user's ``setpriv``, a cgroup to join), ``extra_env`` over that environment (its ``HOME``)."""
    env = {key: os.environ[key] for key in WORKER_ENV if key in os.environ}
    env.update(
        PREFECT_API_URL=prefect_api_url, PREFECT_WORKER_QUERY_SECONDS=str(WORKER_QUERY_SECONDS), PYTHONUNBUFFERED="1"
    )
    env.update(extra_env or {})
    cmd = [venv_bin("opentinker"), "server", "worker", "--server", server_url, "--key-file", str(key_file)]
    return spawn("worker", [*prefix, *cmd], log, url="", ports={}, env=env)


def start_server(
    log: Path,
    port: int | None = None,
    jobs: bool = True,
    env: Mapping[str, str] | None = None,
    timeout: float = 180.0,
) -> ServiceProcess:
    """``opentinker server up`` as a background process on a free loopback port, returned once ``/healthz``
    answers (tests and benches; ``env`` is its whole environment, default ours)."""
    port = port or free_ports(1)[0]
    cmd = [venv_bin("opentinker"), "server", "up", "--host", "127.0.0.1", "--port", str(port)]
    if not jobs:
        cmd.append("--no-jobs")
    return start_http("opentinker-server", cmd, log, port=port, health="/healthz", timeout=timeout, env=env)


PREFECT_SETTINGS = {"PREFECT_SERVER_DATABASE_TIMEOUT": "60", "PREFECT_SERVER_DATABASE_CONNECTION_TIMEOUT": "30"}
"""On SQLite several jobs' logs and states at once make the embedded Prefect wait for its write lock, which by
default fails after 10 s (and a worker whose polls keep failing exits); ``server_prefect_database = postgres`` has
no such lock."""


def embedded_pool_limit() -> int:
    """The embedded stack's capacity: one job per CPU core of this machine. More jobs at once only share the cores
    (no job ends sooner) and their flow runs' writes queue on the embedded Prefect's SQLite lock: 8 small jobs at
    once on 2 cores made a submit wait 72 s, 2 at once kept it under 3 s and finished the burst sooner."""
    return os.cpu_count() or 1


def _start_prefect(root: Path, log: Path, settings: dict[str, str]) -> ServiceProcess:
    from opentinker.infra.services import start_prefect

    return start_prefect(root / "prefect", log, ui=True, settings=settings)


def _postgres(services: RecordedServices, root: Path) -> str:
    """The embedded PostgreSQL (started, or adopted) and the URL of its ``prefect`` database for Prefect's server."""
    from opentinker.infra.postgres import database_url, start_postgres

    postgres = services.ensure("postgres", lambda log: start_postgres(root / "postgres", log)[0])
    return database_url(root / "postgres", postgres, "prefect", driver="asyncpg")


def _worker_key(settings: Settings) -> Path:
    """The embedded worker's key file: reused while its key is valid, else a new key of tenant ``ops``."""
    from .db import Store
    from .keys import KeyRing

    path = server_dir(settings) / "worker.key"
    store = Store(settings.server_database)
    try:
        keyring = KeyRing(store)
        if path.exists() and keyring.authenticate(path.read_text().strip()) is not None:
            return path
        _, key = keyring.create("ops", ("worker",), label="embedded worker of `opentinker server up`")
    finally:
        store.close()
    atomic_write(path, key + "\n", mode=0o600)
    return path


def _around_uvicorn(server, after_startup: Callable[[], None], after_shutdown: Callable[[], object]) -> None:
    """Run ``after_startup`` once uvicorn listens, ``after_shutdown`` once it has shut down gracefully (Ctrl-C,
    SIGTERM; uvicorn then re-raises the signal, so code after ``server.run()`` would never run). Killed, it runs
    neither: the embedded stack stays up for the next ``up`` to adopt."""
    startup, shutdown = server.startup, server.shutdown

    async def startup_then(sockets=None):
        await startup(sockets=sockets)
        if server.started:
            after_startup()

    async def shutdown_then(sockets=None):
        await shutdown(sockets=sockets)
        after_shutdown()

    server.startup, server.shutdown = startup_then, shutdown_then


__all__ = ["serve", "start_server", "start_worker", "stop_services"]
