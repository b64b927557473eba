"""Services in the foreground, as ``opentinker serve``/``agent serve``/``quickstart`` run them: start, report, wait.

The launching itself is ``serving.deploy`` and ``serving.agent_service``; these functions only compose it.
"""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .auth import hash_api_key, resolve_api_key

if TYPE_CHECKING:
    from .agent_service import AgentServiceConfig


@dataclass(frozen=True)
class ServedQuery:
    """One request to a freshly served policy: where it ran, what it was asked, what it answered."""

    url: str
    observation: list[float]
    action: Any


def query_once(model_ref: str, env_id: str) -> ServedQuery:
    """Deploy ``model_ref`` with BentoML on 127.0.0.1, send the env's first observation (seed 0), stop the server."""
    from opentinker.envs import make_env

    from .deploy import deploy

    env = make_env(env_id)
    observation, _ = env.reset(seed=0)
    env.close()
    with deploy(model_ref, api_key=secrets.token_urlsafe(24), host="127.0.0.1") as deployment:
        action = deployment.predict(observation.tolist())
        return ServedQuery(deployment.url, [round(float(x), 3) for x in observation], action)


def serve_policy_until_stopped(
    model_ref: str,
    api_key: str | None,
    api_key_file: Path | None,
    host: str,
    port: int | None,
    settings: dict[str, Any],
    on_ready: Callable[[str], None],
) -> None:
    """Serve a policy until Ctrl+C or SIGTERM, its server's log on this terminal. A bad key or model reference
    fails before any server starts (``ApiKeyError``, ``PolicyStoreError``)."""
    from .deploy import start_server
    from .model_slot import resolve

    key_hash = hash_api_key(resolve_api_key(api_key, api_key_file))
    resolve(model_ref)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a process manager's stop also stops the server
    server = start_server(model_ref, key_hash, host, port, settings)
    assert server.popen is not None and server.url is not None
    _until_stopped(server.popen, server.stop, lambda: on_ready(server.url))


def serve_agent_until_stopped(
    api_key: str | None,
    api_key_file: Path | None,
    config: AgentServiceConfig,
    host: str,
    port: int | None,
    on_ready: Callable[[Any], None],
) -> None:
    """Serve the LLM agent until Ctrl+C; ``on_ready`` gets the ``AgentDeployment`` (url, log path)."""
    from .agent_service import serve_agent

    service = serve_agent(resolve_api_key(api_key, api_key_file), config, host, port)
    _until_stopped(service.process, service.stop, lambda: on_ready(service))


def _until_stopped(process: subprocess.Popen, stop: Callable[[], None], ready: Callable[[], object]) -> None:
    """``ready()``, then wait for the server process; Ctrl+C ends the wait; the server is stopped either way."""
    try:
        ready()
        process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop()
