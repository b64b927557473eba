"""Services started for one folder and recorded there, so that a later process adopts them instead of starting
them again: ``server up``'s embedded stack, ``opentinker train``'s Prefect server."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

from opentinker.infra.files import atomic_write
from opentinker.infra.processes import ServiceError, ServiceProcess


class RecordedServices:
    """Services started for one folder (``server up``'s embedded stack, ``opentinker train``'s Prefect server),
    recorded by pid and start time in its ``services.json`` so a later process adopts them."""

    def __init__(self, root: Path):
        self.root = root
        self.state = root / "services.json"

    def _read(self) -> dict[str, dict]:
        return json.loads(self.state.read_text()) if self.state.exists() else {}

    def ensure(
        self, name: str, start: Callable[[Path], ServiceProcess], config: Mapping[str, str] | None = None
    ) -> ServiceProcess:
        """The running service ``name``, adopted, or started and recorded with ``config``."""
        service = self.adopt(name, config)
        if service is None:
            service = start(self.root / "logs" / f"{name}.log")
            service.config = dict(config or {})
            self._write({**self._read(), name: service.to_dict()})
        return service

    def adopt(self, name: str, config: Mapping[str, str] | None = None) -> ServiceProcess | None:
        """The recorded service ``name`` if it still runs. ``config`` is what it must have been started with (its
        database, the API it serves): one left running with another is refused, not adopted, so a restart with new
        settings never quietly keeps the old ones."""
        recorded = self._read().get(name)
        if recorded is None:
            return None
        service = ServiceProcess.from_dict(recorded)
        if not service.alive():
            return None
        was = service.config
        changed = {key: value for key, value in (config or {}).items() if was.get(key) != value}
        if changed:
            differences = ", ".join(f"{key} {was.get(key)!r} (now {value!r})" for key, value in changed.items())
            raise ServiceError(
                f"the embedded {name} (pid {service.pid}) left running by an earlier `opentinker server up` has "
                f"{differences}: stop it with `opentinker server down`, or start `up` as before"
            )
        return service

    def stop_all(self) -> list[str]:
        """Stop the services, the last started first (the worker before Prefect, Prefect before its database)."""
        stopped = []
        for name, recorded in reversed(self._read().items()):
            service = ServiceProcess.from_dict(recorded)
            if service.alive():
                service.stop()
                stopped.append(name)
        self.state.unlink(missing_ok=True)
        return stopped

    def _write(self, data: dict) -> None:
        atomic_write(self.state, json.dumps(data, indent=1), mode=0o600)
