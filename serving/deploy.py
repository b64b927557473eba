"""Start a policy service as a real ``bentoml serve`` process and hand back a client for it.

    with deploy("models:/cartpole@champion", api_key="s3cret") as service:
        service.predict([0.0, 0.1, 0.0, -0.1])

The key stays in this process: the server gets only its scrypt hash (``OPENTINKER_SERVE_API_KEY_HASH``),
and ``OPENTINKER_API_KEY`` is removed from the child's environment.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import numpy as np

from opentinker.envs.observations import batch_len, index_obs, map_obs, to_jsonable
from opentinker.infra.processes import ServiceError, ServiceProcess, free_ports, start_http

from .auth import API_KEY_ENV, HASH_ENV, hash_api_key, resolve_api_key

SERVICE_IMPORT = "opentinker.serving.policy_service:PolicyService"
STARTUP_FAILED = "Application startup failed"
"""BentoML's log line when the service's __init__ raised (its supervisor then keeps restarting the worker)."""


class DeploymentError(ServiceError):
    """The server process exited or did not become ready; the message carries its log tail."""


def bento_env(key_hash: str, extra: dict[str, str]) -> dict[str, str]:
    """A BentoML child's environment: ours minus any plaintext key, plus the key's hash and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    env.update({HASH_ENV: key_hash, "BENTOML_DO_NOT_TRACK": "True", **extra})
    return env


def server_env(model_ref: str | Path, key_hash: str, settings: dict[str, Any] | None = None) -> dict[str, str]:
    """The policy server's environment: ``bento_env`` plus the model and ``ServeSettings`` overrides."""
    settings_env = {f"OPENTINKER_SERVE_{k.upper()}": str(v) for k, v in (settings or {}).items()}
    return bento_env(key_hash, {"OPENTINKER_SERVE_MODEL": str(model_ref), **settings_env})


def start_bento(
    name: str,
    service_import: str,
    env: dict[str, str],
    host: str = "127.0.0.1",
    port: int | None = None,
    log: Path | None = None,
    ready_timeout_s: float = 180.0,
) -> ServiceProcess:
    """``bentoml serve`` in its own session on ``host:port`` (a free port by default), returned once ``/readyz``
    answers; ``log`` None leaves its output on our terminal. Raises ``DeploymentError`` with the log tail."""
    port = port or free_ports(1, host)[0]
    cmd = [sys.executable, "-m", "bentoml", "serve", service_import, "--host", host, "--port", str(port)]
    return start_http(
        name,
        cmd,
        log,
        port=port,
        health="/readyz",
        timeout=ready_timeout_s,
        host=host,
        env=env,
        fails_on=STARTUP_FAILED,
        stop_timeout=15.0,
        error=DeploymentError,
    )


def start_server(
    model_ref: str | Path,
    key_hash: str,
    host: str = "127.0.0.1",
    port: int | None = None,
    settings: dict[str, Any] | None = None,
    log: Path | None = None,
    ready_timeout_s: float = 180.0,
) -> ServiceProcess:
    """The policy service for ``model_ref``, ready; the child gets only the key's hash."""
    env = server_env(model_ref, key_hash, settings)
    return start_bento("bentoml serve", SERVICE_IMPORT, env, host, port, log, ready_timeout_s)


@dataclass
class Served:
    """A running BentoML service started here: its URL, its process and ``stop()`` (also as a context manager)."""

    url: str
    service: ServiceProcess
    log_path: Path | None
    _api_key: str = field(repr=False)

    @property
    def process(self) -> subprocess.Popen:
        """The ``bentoml serve`` supervisor process (``.pid``, ``.poll()``, ``.wait()``)."""
        assert self.service.popen is not None
        return self.service.popen

    def stop(self) -> None:
        """Stop the server and every process under it (BentoML's workers run in their own sessions), then reap."""
        self.service.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Deployment(Served):
    """A running policy service: its URL, an authenticated client and ``stop()``."""

    model_ref: str = ""
    _client: Any = field(default=None, repr=False)

    @property
    def client(self):
        """``bentoml.SyncHTTPClient`` sending ``Authorization: Bearer <key>``."""
        if self._client is None:
            import bentoml

            self._client = bentoml.SyncHTTPClient(self.url, token=self._api_key, timeout=30)
        return self._client

    def predict(self, obs: Any, return_info: bool = False) -> Any:
        """The action for one observation (an int for discrete actions; a dict of arrays for a Dict space); with
        ``return_info`` the full response dict."""
        result = self.client.act(obs=to_jsonable(obs), return_info=return_info)
        return result if return_info else result["action"]

    def predict_batch(self, obs_batch: Any) -> np.ndarray:
        """Actions for a batch of observations (one request; the server may merge it with others). Dict/Tuple
        observations: a list of them, or a dict/tuple of batched arrays."""
        if isinstance(obs_batch, (dict, tuple)):
            obs_batch = [index_obs(obs_batch, i) for i in range(batch_len(obs_batch))]
        return np.asarray(self.client.act_batch(obs=to_jsonable(obs_batch)))

    def metadata(self) -> dict[str, Any]:
        return self.client.metadata()

    def reload(self) -> dict[str, Any]:
        """Ask the server to re-resolve its model URI now (it also polls on its own)."""
        return self.client.reload()

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        super().stop()


def deploy(
    model_ref: str | Path,
    api_key: str,
    host: str = "127.0.0.1",
    port: int | None = None,
    *,
    settings: dict[str, Any] | None = None,
    log_path: str | Path | None = None,
    ready_timeout_s: float = 180.0,
) -> Deployment:
    """Serve ``model_ref`` (registry URI or export dir) on ``host:port`` (a free port by default) and wait until ready.

    ``settings`` overrides ``ServeSettings`` fields for this server (e.g. ``{"reload_interval_s": 2}``).
    The log goes to ``log_path`` (default: ``<data_dir>/serving/policy-<port>.log``). A URI that does not
    resolve raises ``PolicyStoreError`` at once; a server that fails to start raises ``DeploymentError``.
    """
    from opentinker.infra.settings import get_settings

    from .model_slot import resolve

    key_hash = hash_api_key(api_key)
    resolve(str(model_ref))  # a bad URI fails here, with the store's message, before any server starts
    port = port or free_ports(1, host)[0]
    log_file = Path(log_path) if log_path else get_settings().resolved_data_dir / "serving" / f"policy-{port}.log"
    service = start_server(model_ref, key_hash, host, port, settings, log_file, ready_timeout_s)
    return Deployment(url=service.url, service=service, log_path=log_file, _api_key=api_key, model_ref=str(model_ref))


@dataclass(frozen=True)
class ServedQuery:
    """One request to a freshly served policy: where it ran, what it was asked, what it answered."""

    url: str
    observation: Any
    """The observation as JSON sent it (floats rounded to 3 places): a list, or a dict for a Dict space."""
    action: Any


def query_once(model_ref: str, env_id: str) -> ServedQuery:
    """Deploy ``model_ref`` with BentoML on 127.0.0.1, send the env's first observation (seed 0), stop the server."""
    from opentinker.envs import make_env

    env = make_env(env_id)
    observation, _ = env.reset(seed=0)
    env.close()
    with deploy(model_ref, api_key=secrets.token_urlsafe(24), host="127.0.0.1") as deployment:
        action = deployment.predict(observation)
        return ServedQuery(deployment.url, to_jsonable(map_obs(_three_places, observation)), action)


def _three_places(leaf: Any) -> Any:
    leaf = np.asarray(leaf)
    return np.round(leaf.astype(np.float64), 3) if leaf.dtype.kind == "f" else leaf


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
    from .model_slot import resolve

    key_hash = hash_api_key(resolve_api_key(api_key, api_key_file))
    resolve(model_ref)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a process manager's stop also stops the server
    server = start_server(model_ref, key_hash, host, port, settings)
    assert server.popen is not None and server.url is not None
    until_stopped(server.popen, server.stop, lambda: on_ready(server.url))


def until_stopped(process: subprocess.Popen, stop: Callable[[], None], ready: Callable[[], object]) -> None:
    """``ready()``, then wait for the server process; Ctrl+C ends the wait; the server is stopped either way."""
    try:
        ready()
        process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop()
