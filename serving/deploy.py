"""Start a policy service as a real ``bentoml serve`` process and hand back a client for it.

    with deploy("models:/cartpole@champion", api_key="s3cret") as service:
        service.predict([0.0, 0.1, 0.0, -0.1])

The key stays in this process: the server gets only its scrypt hash (``OPENTINKER_SERVE_API_KEY_HASH``),
and ``OPENTINKER_API_KEY`` is removed from the child's environment.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from .auth import API_KEY_ENV, HASH_ENV, hash_api_key

SERVICE_IMPORT = "opentinker.serving.policy_service:PolicyService"
STARTUP_FAILED = "Application startup failed"
"""BentoML's log line when the service's __init__ raised (its supervisor then keeps restarting the worker)."""


class DeploymentError(RuntimeError):
    """The server process exited or did not become ready; the message carries its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just handed out (bind to 0); never a fixed one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def server_env(model_ref: str | Path, key_hash: str, settings: dict[str, Any] | None = None) -> dict[str, str]:
    """The child's environment: ours minus any plaintext key, plus the model, the key hash and settings."""
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    env.update({"OPENTINKER_SERVE_MODEL": str(model_ref), HASH_ENV: key_hash, "BENTOML_DO_NOT_TRACK": "True"})
    env.update({f"OPENTINKER_SERVE_{k.upper()}": str(v) for k, v in (settings or {}).items()})
    return env


def start_server(
    model_ref: str | Path,
    key_hash: str,
    host: str = "127.0.0.1",
    port: int | None = None,
    settings: dict[str, Any] | None = None,
    log: IO[bytes] | None = None,
) -> tuple[subprocess.Popen, str]:
    """Launch ``bentoml serve`` in its own process group; returns the process and its base URL."""
    port = port or free_port(host)
    cmd = [sys.executable, "-m", "bentoml", "serve", SERVICE_IMPORT, "--host", host, "--port", str(port)]
    proc = subprocess.Popen(
        cmd,
        env=server_env(model_ref, key_hash, settings),
        stdout=log,
        stderr=subprocess.STDOUT if log is not None else None,
        start_new_session=True,
    )
    return proc, f"http://{host}:{port}"


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 180.0, log_path: Path | None = None) -> None:
    """Poll ``/readyz`` until 200; fail fast, with the log tail, if the process dies."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DeploymentError(f"bentoml serve exited with code {proc.returncode}{_log_tail(log_path)}")
        if log_path is not None and log_path.exists() and STARTUP_FAILED in log_path.read_text(errors="replace"):
            raise DeploymentError(f"the service failed to start{_log_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.25)
    raise DeploymentError(f"{url} not ready after {timeout_s:.0f} s{_log_tail(log_path)}")


def stop_process_group(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """Stop the server and every process under it, then reap them.

    BentoML's supervisor starts its workers in their own sessions, so the process group is not
    enough: descendants are collected first and any survivor of the supervisor's SIGTERM is killed.
    """
    import psutil

    if proc.poll() is not None:
        return
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout_s)
    _, alive = psutil.wait_procs(children, timeout=timeout_s)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(alive, timeout=timeout_s)


def _log_tail(log_path: Path | None, lines: int = 30) -> str:
    if log_path is None or not log_path.exists():
        return ""
    return "\n--- server log (tail) ---\n" + "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Deployment:
    """A running policy service: its URL, an authenticated client and ``stop()``."""

    url: str
    model_ref: str
    process: subprocess.Popen
    log_path: Path | None
    _api_key: str = field(repr=False)
    _client: Any = field(default=None, repr=False)

    @property
    def client(self):
        """``bentoml.SyncHTTPClient`` sending ``Authorization: Bearer <key>``."""
        if self._client is None:
            import bentoml

            self._client = bentoml.SyncHTTPClient(self.url, token=self._api_key, timeout=30)
        return self._client

    def predict(self, obs: Any, return_info: bool = False) -> Any:
        """The action for one observation (an int for discrete actions); with ``return_info`` the full response dict."""
        result = self.client.act(obs=np.asarray(obs).tolist(), return_info=return_info)
        return result if return_info else result["action"]

    def predict_batch(self, obs_batch: Any) -> np.ndarray:
        """Actions for a batch of observations (one request; the server may merge it with others)."""
        return np.asarray(self.client.act_batch(obs=np.asarray(obs_batch).tolist()))

    def metadata(self) -> dict[str, Any]:
        return self.client.metadata()

    def reload(self) -> dict[str, Any]:
        """Ask the server to re-resolve its model URI now (it also polls on its own)."""
        return self.client.reload()

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        stop_process_group(self.process)

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
    port = port or free_port(host)
    log_file = Path(log_path) if log_path else get_settings().resolved_data_dir / "serving" / f"policy-{port}.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log:
        proc, url = start_server(model_ref, key_hash, host, port, settings, log)
    try:
        wait_ready(url, proc, ready_timeout_s, log_file)
    except BaseException:
        stop_process_group(proc)
        raise
    return Deployment(url=url, model_ref=str(model_ref), process=proc, log_path=log_file, _api_key=api_key)
