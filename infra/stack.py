"""The local service stack behind ``opentinker stack up|down|status``.

State lives in ``<data_dir>/stack/``: ``state.json`` (pids, ports, URLs), ``logs/``, each service's data,
and ``stack.env`` with the ``OPENTINKER_*`` variables that point the settings at the running stack.
``down`` stops only processes recorded by ``up`` (pid *and* start time must match).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from opentinker.infra.files import atomic_write
from opentinker.infra.processes import ServiceError, ServiceProcess
from opentinker.infra.services import (
    DEFAULT_TIMEOUT_S,
    S3Endpoint,
    s3_credentials,
    start_mlflow,
    start_prefect,
    start_s3,
)
from opentinker.infra.settings import Settings, get_settings

SERVICES = ("s3", "mlflow", "prefect")
BACKENDS = ("sqlite", "postgres")


class StackError(RuntimeError):
    """The stack cannot be started or is in a state that needs the user's attention."""


@dataclass
class ServiceStatus:
    name: str
    running: bool
    url: str
    pid: int | None
    log: str


class Stack:
    """Start, inspect and stop the local services recorded under ``root`` (default ``<data_dir>/stack``)."""

    def __init__(self, root: Path | None = None, settings: Settings | None = None):
        self.settings = settings or get_settings()
        self.root = (root or self.settings.resolved_data_dir / "stack").resolve()
        self.state_path = self.root / "state.json"
        self.env_path = self.root / "stack.env"

    # ---- state -------------------------------------------------------------------------------
    def _read_state(self) -> dict:
        if not self.state_path.exists():
            return {"services": {}}
        try:
            return json.loads(self.state_path.read_text())
        except json.JSONDecodeError as exc:
            raise StackError(
                f"{self.state_path} is corrupt ({exc}); stop leftover processes by hand and delete it."
            ) from exc

    def _write_state(self, state: dict) -> None:
        atomic_write(self.state_path, json.dumps(state, indent=2), mode=0o600)

    def services(self) -> dict[str, ServiceProcess]:
        return {name: ServiceProcess.from_dict(data) for name, data in self._read_state()["services"].items()}

    def s3_endpoint(self) -> S3Endpoint | None:
        """The recorded endpoint; its secret is read from the owner-only credentials file, never from state.json."""
        data = self._read_state().get("s3")
        if not data:
            return None
        access, secret = s3_credentials(self.root / "s3")
        return S3Endpoint(**{**data, "access_key": access, "secret_key": secret})

    # ---- commands ----------------------------------------------------------------------------
    def up(
        self,
        timeout: float = DEFAULT_TIMEOUT_S,
        ui: bool = True,
        backend: str = "sqlite",
        on_step: Callable[[str], None] = lambda message: None,
    ) -> list[ServiceStatus]:
        """Start S3, then MLflow (artifacts proxied to S3), then Prefect; a no-op when all already run.

        If any service fails, everything started by this call is stopped again and ``StackError`` says why.
        """
        if backend not in BACKENDS:
            raise StackError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        running = {name: svc for name, svc in self.services().items() if svc.alive()}
        if set(running) >= set(SERVICES):
            return self.status()
        if running:
            raise StackError(
                f"part of the stack is still running ({', '.join(sorted(running))}); run `opentinker stack down` first."
            )
        logs = self.root / "logs"
        started: list[ServiceProcess] = []
        state: dict = {"services": {}, "backend": backend}
        try:
            on_step("S3 (SeaweedFS)")
            s3, endpoint = start_s3(
                self.root / "s3",
                logs / "s3.log",
                bucket=self.settings.s3_bucket,
                region=self.settings.s3_region,
                timeout=timeout,
            )
            started.append(s3)
            state["s3"] = endpoint.public_dict()
            backend_uri = None
            if backend == "postgres":
                from opentinker.infra.postgres import start_postgres

                on_step("PostgreSQL")
                postgres, backend_uri = start_postgres(self.root / "postgres", logs / "postgres.log", timeout=timeout)
                started.append(postgres)
            on_step("MLflow server")
            started.append(
                start_mlflow(
                    self.root / "mlflow", logs / "mlflow.log", endpoint, backend_store_uri=backend_uri, timeout=timeout
                )
            )
            on_step("Prefect server")
            started.append(start_prefect(self.root / "prefect", logs / "prefect.log", ui=ui, timeout=timeout))
        except ServiceError as exc:
            for service in reversed(started):
                service.stop()
            raise StackError(str(exc)) from exc
        except BaseException:
            for service in reversed(started):
                service.stop()
            raise
        state["services"] = {svc.name: svc.to_dict() for svc in started}
        self._write_state(state)
        self.write_env_file()
        return self.status()

    def down(self) -> list[str]:
        """Stop every recorded service that is still the process ``up`` started; returns their names."""
        stopped = []
        for name, service in reversed(list(self.services().items())):
            if service.alive():
                service.stop()
                stopped.append(name)
        if self.state_path.exists():
            state = self._read_state()
            state["services"] = {}
            self._write_state(state)
        self.env_path.unlink(missing_ok=True)
        return stopped

    def status(self) -> list[ServiceStatus]:
        recorded = self.services()
        rows = []
        for name in (*SERVICES[:1], "postgres", *SERVICES[1:]):
            service = recorded.get(name)
            if service is None and name == "postgres":
                continue
            if service is None:
                rows.append(ServiceStatus(name, False, "", None, str(self.root / "logs" / f"{name}.log")))
            else:
                alive = service.alive()
                rows.append(ServiceStatus(name, alive, service.url, service.pid if alive else None, service.log))
        return rows

    def env(self) -> dict[str, str]:
        """Variables that point OpenTinker (and the mlflow/prefect/boto3 clients) at the running stack."""
        services = {name: svc for name, svc in self.services().items() if svc.alive()}
        env: dict[str, str] = {}
        endpoint = self.s3_endpoint()
        if "s3" in services and endpoint:
            env.update(
                OPENTINKER_S3_ENDPOINT_URL=endpoint.endpoint_url,
                OPENTINKER_S3_BUCKET=endpoint.bucket,
                OPENTINKER_S3_ACCESS_KEY=endpoint.access_key,
                OPENTINKER_S3_SECRET_KEY=endpoint.secret_key,
                OPENTINKER_S3_REGION=endpoint.region,
            )
            env.update(endpoint.client_env())
        if "mlflow" in services:
            env.update(
                OPENTINKER_MLFLOW_TRACKING_URI=services["mlflow"].url, MLFLOW_TRACKING_URI=services["mlflow"].url
            )
        if "prefect" in services:
            api = f"{services['prefect'].url}/api"
            env.update(OPENTINKER_PREFECT_API_URL=api, PREFECT_API_URL=api)
        return env

    def write_env_file(self) -> Path:
        """``stack.env``: ``source`` it in a shell to use the stack (owner-only permissions: it holds the S3 secret)."""
        lines = ["# Written by `opentinker stack up`; `source` this file to point OpenTinker at the local stack."]
        lines += [f"export {key}={value}" for key, value in self.env().items()]
        atomic_write(self.env_path, "\n".join(lines) + "\n", mode=0o600)
        return self.env_path
