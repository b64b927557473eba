"""Every training client is an MLflow run in its tenant's experiment; its checkpoints are recorded on it.

Per optimiser step the run gets what the SDK sees (the summed loss of the step's ``forward_backward`` calls, the
gradient norm, the learning rate) and what the service measures (tokens/s of the passes, seconds per step); per
sampling request of its samplers, the latency and tokens/s. One writer thread owns every MLflow call, so tracking
never holds up a request; runs go to the tenant's store (``server.tenants.tracking_uri``), never the process-wide one,
as the tenant's own MLflow user where there are MLflow users (made and handed over by the API: the engine holds no
admin and derives no password).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentinker.infra.settings import Settings
from opentinker.server import tenants
from opentinker.server.mlflow_users import Credentials

log = logging.getLogger(__name__)


@dataclass(eq=False)
class ClientRun:
    """One training client's run; its methods only queue writes (called from the worker thread)."""

    writer: TrackingWriter
    tenant: str
    run_id: str | None = None
    step: int = 0
    loss: float = 0.0
    tokens: int = 0
    seconds: float = 0.0
    last_step: float = field(default_factory=time.perf_counter)

    def forward_backward(self, loss: float, tokens: int, seconds: float) -> None:
        self.loss, self.tokens, self.seconds = self.loss + loss, self.tokens + tokens, self.seconds + seconds

    def optim_step(self, metrics: dict[str, float]) -> None:
        now = time.perf_counter()
        self.step += 1
        values = {
            "train/loss": self.loss,
            "train/tokens": float(self.tokens),
            "train/tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
            "train/grad_norm": metrics["grad_norm"],
            "train/learning_rate": metrics["learning_rate"],
            "train/seconds_per_step": now - self.last_step,
        }
        self.loss, self.tokens, self.seconds, self.last_step = 0.0, 0, 0.0, now
        self.writer.log(self, values, self.step)

    def sample(self, latency_s: float, tokens: int, seconds: float) -> None:
        values = {"sample/latency_s": latency_s, "sample/tokens_per_s": tokens / seconds if seconds else 0.0}
        self.writer.log(self, values, self.step)

    def checkpoint(self, uri: str) -> None:
        kind, name = uri.rsplit("/", 2)[-2:]
        self.writer.tag(self, f"checkpoint.{kind}.{name}", uri)

    def end(self, status: str = "FINISHED") -> None:
        self.writer.submit(lambda client: client.set_terminated(self.run_id, status), self)


class TrackingWriter:
    """The thread behind every ``ClientRun``; ``close`` writes what is queued, then stops."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._queue: queue.Queue[tuple[Callable[[Any], None], ClientRun] | None] = queue.Queue()
        self._clients: dict[str, Any] = {}
        self._users: dict[str, Credentials | None] = {}
        self._thread = threading.Thread(target=self._loop, name="tinker-tracking", daemon=True)
        self._thread.start()

    def start_run(self, tenant: str, name: str, params: dict[str, Any], tags: dict[str, str]) -> ClientRun:
        run = ClientRun(self, tenant)

        def create(client: Any) -> None:
            experiment_id = self.experiment(client, tenant)
            created = client.create_run(experiment_id, run_name=name, tags={"opentinker.source": "tinker-api", **tags})
            run.run_id = created.info.run_id
            for key, value in params.items():
                client.log_param(run.run_id, key, str(value)[:6000])

        self._queue.put((create, run))
        return run

    def log(self, run: ClientRun, values: dict[str, float], step: int) -> None:
        def write(client: Any) -> None:
            from mlflow.entities import Metric

            stamp = int(time.time() * 1000)
            client.log_batch(run.run_id, metrics=[Metric(k, float(v), stamp, step) for k, v in values.items()])

        self.submit(write, run)

    def tag(self, run: ClientRun, key: str, value: str) -> None:
        self.submit(lambda client: client.set_tag(run.run_id, key, value), run)

    def submit(self, fn: Callable[[Any], None], run: ClientRun) -> None:
        self._queue.put((fn, run))

    def flush(self, timeout: float = 30.0) -> None:
        done = threading.Event()
        self._queue.put((lambda client: done.set(), ClientRun(self, "")))
        done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, run = item
            try:
                fn(self.client(run.tenant) if run.tenant else None)
            except Exception:
                log.exception("tracking write failed")

    def set_user(self, tenant: str, user: Credentials | None) -> None:
        """The tenant's own MLflow user, handed by the API once it made the tenant's experiment and names
        (``remote.EngineClient.prepare``; None: its store takes none, the embedded stack). Applied on the writer
        thread, in order: a run started after it is written as that user."""

        def use(_: Any) -> None:
            if tenant not in self._users or self._users[tenant] != user:
                self._users[tenant] = user
                self._clients.pop(tenant, None)

        self.submit(use, ClientRun(self, ""))

    def uri(self, tenant: str) -> str:
        """The tenant's tracking store, with its MLflow user where the API handed one (never print it)."""
        from ..mlflow_users import uri_with

        uri = tenants.tracking_uri(tenant, self.settings)
        user = self._users.get(tenant)
        return uri_with(uri, user) if user else uri

    def client(self, tenant: str) -> Any:
        """The tenant's MLflow client: its own store on the embedded stack; on an MLflow server with its
        authentication app, the tenant's own MLflow user, never the operator's (the engine holds none)."""
        if tenant not in self._clients:
            from mlflow import MlflowClient

            uri = self.uri(tenant)
            self._clients[tenant] = MlflowClient(tracking_uri=uri, registry_uri=uri)
        return self._clients[tenant]

    def experiment(self, client: Any, tenant: str) -> str:
        """The id of the tenant's experiment (made by ``client``)."""
        return client.get_experiment_by_name(tenants.experiment(tenant)).experiment_id
