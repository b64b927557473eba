"""``opentinker server up``: the API (uvicorn serving ``create_app``) in the foreground of this process."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from opentinker.infra.processes import ServiceProcess, free_ports, start_http, venv_bin


def serve(host: str, port: int, jobs: bool = True, on_ready: Callable[[str], None] | None = None) -> None:
    """Serve the API on ``host:port`` until interrupted."""
    import uvicorn

    from .app import create_app

    app = create_app(jobs=jobs)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    if on_ready is not None:
        _announce_when_started(server, f"http://{host}:{port}", on_ready)
    server.run()


def _announce_when_started(server, url: str, on_ready: Callable[[str], None]) -> None:
    """Call ``on_ready(url)`` once uvicorn listens (its ``startup`` has bound the socket and run the lifespan)."""
    startup = server.startup

    async def startup_then_announce(sockets=None):
        await startup(sockets=sockets)
        if server.started:
            on_ready(url)

    server.startup = startup_then_announce


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
