"""The server's Python client: what ``opentinker login|submit|jobs`` and ``opentinker.connect()`` talk through.

httpx and the shared schemas only, never the app: importing it pulls in neither FastAPI nor Prefect. Where the
server and key come from, first found wins: the arguments, ``connect()`` in this process, the settings
(``OPENTINKER_SERVER_URL`` / ``OPENTINKER_API_KEY``), the credentials ``opentinker login`` stored (mode 0600).

A submission carries an idempotency key, made once per submission: the client retries a submit that failed on the
network with the same key, so a dropped connection never makes two jobs.
"""

from __future__ import annotations

import json
import time
import tomllib
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from opentinker.infra.files import atomic_write
from opentinker.infra.settings import get_settings

from .packaging import pack_package, top_package

FINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
SUBMIT_ATTEMPTS = 5


class ServerError(RuntimeError):
    """The server refused a request; ``str()`` is one line with the status and the server's reason."""

    def __init__(self, status: int, detail: str, retry_after: str | None = None):
        super().__init__(f"server answered {status}: {detail}")
        self.status, self.detail, self.retry_after = status, detail, retry_after


class NotConnected(RuntimeError):
    """No server configured: ``opentinker login URL`` or ``opentinker.connect(url, api_key=...)`` first."""


_current: Client | None = None


def connect(url: str | None = None, api_key: str | None = None) -> Client:
    """Check the key against the server and make it this process's server: the SDK's trainers then run as jobs."""
    global _current
    client = Client(url, api_key)
    client.whoami()
    _current = client
    return client


def disconnect() -> None:
    """Back to local training."""
    global _current
    _current = None


def current() -> Client | None:
    """The server ``connect()`` chose, else the one the settings name (``OPENTINKER_SERVER_URL``), else None."""
    if _current is not None:
        return _current
    settings = get_settings()
    return Client(settings.server_url, settings.api_key or None) if settings.server_url else None


def save_credentials(url: str, api_key: str) -> Path:
    """Store the server and key for later commands, readable only by the owner (``opentinker login``)."""
    path = get_settings().credentials_file.expanduser()
    return atomic_write(path, json.dumps({"url": url, "api_key": api_key}), mode=0o600)


def stored_credentials() -> dict[str, str]:
    path = get_settings().credentials_file.expanduser()
    return json.loads(path.read_text()) if path.is_file() else {}


class Client:
    """One server and key; every method is one HTTP call (or one stream) and raises ``ServerError`` on a refusal."""

    def __init__(self, url: str | None = None, api_key: str | None = None, timeout: float = 60.0):
        settings, stored = get_settings(), stored_credentials()
        self.url = (url or settings.server_url or stored.get("url") or "").rstrip("/")
        key = api_key or settings.api_key or stored.get("api_key")
        if not self.url or not key:
            raise NotConnected(
                "no OpenTinker server: run `opentinker login URL`, call opentinker.connect(url, api_key=...), "
                "or set OPENTINKER_SERVER_URL and OPENTINKER_API_KEY"
            )
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)
        weakref.finalize(self, self.http.close)

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        answer = self.http.request(method, path, **kwargs)
        if answer.status_code >= 400:
            raise _error(answer)
        return answer.json() if answer.content else None

    def whoami(self) -> dict[str, Any]:
        return self._call("GET", "/v1/whoami")

    def upload_package(self, name: str) -> dict[str, Any]:
        """Pack the importable package ``name`` and upload it (the same archive again returns the same upload)."""
        data, filename = pack_package(name)
        return self.upload(data, filename)

    def upload(self, data: bytes, filename: str) -> dict[str, Any]:
        return self._call(
            "POST",
            "/v1/uploads",
            params={"filename": filename},
            content=data,
            headers={"Content-Type": "application/octet-stream"},
        )

    def submit(
        self,
        spec: dict[str, Any],
        priority: int = 0,
        wheel: Path | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """Queue a job for ``spec`` (RunSpec fields in config form); a ``package.module:Class`` env has its
        package (or ``wheel``) uploaded first. Network failures are retried with the same idempotency key."""
        body: dict[str, Any] = {
            "spec": spec,
            "priority": priority,
            "idempotency_key": idempotency_key or str(uuid.uuid4()),
        }
        package = top_package(str(spec.get("env_id", "")))
        if wheel is not None:
            body["upload_id"] = self.upload(Path(wheel).read_bytes(), Path(wheel).name)["id"]
        elif package is not None:
            body["upload_id"] = self.upload_package(package)["id"]
        for attempt in range(SUBMIT_ATTEMPTS):
            try:
                return self._call("POST", "/v1/jobs", json=body)
            except httpx.TransportError:
                if attempt == SUBMIT_ATTEMPTS - 1:
                    raise
                time.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")

    def job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def jobs(self, state: str | None = None) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/jobs", params={"state": state} if state else None)

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")

    def resume(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/jobs/{job_id}/resume")

    def result(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}/result")

    def policy(self, job_id: str, directory: Path) -> Path:
        """Download the finished job's exported policy (``policy.json`` + ``weights.npz``) into ``directory``."""
        answer = self.http.get(f"/v1/jobs/{job_id}/policy")
        if answer.status_code >= 400:
            raise _error(answer)
        directory.mkdir(parents=True, exist_ok=True)
        import io
        import tarfile

        with tarfile.open(fileobj=io.BytesIO(answer.content), mode="r:gz") as archive:
            archive.extractall(directory, filter="data")
        return directory

    def logs(self, job_id: str, follow: bool = False) -> Iterator[dict[str, Any]]:
        """The job's log lines; with ``follow`` until the job ends."""
        with self.http.stream("GET", f"/v1/jobs/{job_id}/logs", params={"follow": follow}, timeout=None) as answer:
            if answer.status_code >= 400:
                answer.read()
                raise _error(answer)
            for line in answer.iter_lines():
                if line:
                    yield json.loads(line)

    def events(self, job_id: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """The job's server-sent events as (event, data) until its ``end`` event."""
        with self.http.stream("GET", f"/v1/jobs/{job_id}/events", timeout=None) as answer:
            if answer.status_code >= 400:
                answer.read()
                raise _error(answer)
            event, data = "message", []
            for line in answer.iter_lines():
                if line.startswith("event:"):
                    event = line.removeprefix("event:").strip()
                elif line.startswith("data:"):
                    data.append(line.removeprefix("data:").strip())
                elif not line and data:
                    yield event, json.loads("\n".join(data))
                    if event == "end":
                        return
                    event, data = "message", []

    def wait(self, job_id: str, on_update=None) -> dict[str, Any]:
        """Follow the job's events until it ends (reconnecting if the stream drops); returns its final status."""
        while True:
            try:
                for event, data in self.events(job_id):
                    if event == "status" and on_update is not None:
                        on_update(data)
                    if event == "end":
                        return self.job(job_id)
            except httpx.TransportError:
                time.sleep(1.0)

    def dashboard(self) -> dict[str, Any]:
        """The tenant's MLflow UI and its MLflow user (``GET /v1/dashboard``; 409 on the embedded stack)."""
        return self._call("GET", "/v1/dashboard")

    def deploy(self, job_id: str, api_key_hash: str | None = None) -> dict[str, Any]:
        """A policy service for the job's registered model, on the server (behind ``api_key_hash`` and the tenant's
        keys through ``/v1/services/{id}/act``)."""
        return self._call("POST", "/v1/services", json={"job_id": job_id, "api_key_hash": api_key_hash})

    def act(self, service_id: str, obs: Any) -> dict[str, Any]:
        return self._call("POST", f"/v1/services/{service_id}/act", json={"obs": obs})

    def stop_service(self, service_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/services/{service_id}")


def spec_from(
    env_id: str,
    config: Path | None = None,
    algorithm: str | None = None,
    steps: int | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    """A job spec as ``opentinker train`` reads one: the config file (TOML or JSON) with the flags on top."""
    spec: dict[str, Any] = {}
    if config is not None:
        text = Path(config).read_text()
        spec = json.loads(text) if Path(config).suffix == ".json" else tomllib.loads(text)
    overrides = {"env_id": env_id, "algorithm": algorithm, "steps": steps, "seed": seed}
    spec.update({key: value for key, value in overrides.items() if value is not None})
    return spec


def _error(answer: httpx.Response) -> ServerError:
    try:
        detail = answer.json().get("detail", answer.text)
    except ValueError:
        detail = answer.text or answer.reason_phrase
    if not isinstance(detail, str):
        detail = json.dumps(detail)
    return ServerError(answer.status_code, detail, answer.headers.get("retry-after"))
