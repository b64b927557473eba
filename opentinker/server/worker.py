"""The server's Prefect worker: Prefect's own process worker, whose every run is one job attempt's trusted side.

``opentinker server worker`` (and ``server up``, for its embedded worker) runs it: it takes runs from the work pool,
respects the pool's and queues' concurrency limits and cancels runs as Prefect's process worker does. It asks the
server twice a second (``PREFECT_WORKER_QUERY_SECONDS``) what is queued and running, and polls Prefect only when that
changed (or every ``PREFECT_POLL_S``): each Prefect poll writes to Prefect's database, and on the embedded SQLite
those writes, twice a second, made a submit's ``create_flow_run`` fail on the write lock and wait out the client's
2 s retry. Only the command differs, and it is fixed in code, not taken from the pool's job
template: before a run starts, the worker asks the server for that run's launch (``launches.py``), then starts
``python -m opentinker.server.attempt`` with the launch in its environment — trusted code, which runs the flow run and
starts the tenant's code in a sandbox of its own (``attempt.py``). A run the server does not know is refused, so
nothing else reaching Prefect's API can make this worker run a command; and no job's code ever reaches Prefect.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from prefect.workers.process import ProcessWorker

from opentinker.infra.settings import get_settings

from .attempt import LAUNCH_VARIABLE
from .orchestration import HEARTBEAT_S, POOL, WORKER_QUERY_SECONDS
from .prefect_private import OneSlotPerTakenRun
from .sandbox import base_env, check_available
from .sandboxed import SCRATCH_ROOT_VARIABLE
from .schemas import LaunchInfo, PendingWork

ATTEMPT_COMMAND = (sys.executable, "-m", "opentinker.server.attempt")
PASSED = (
    "PREFECT_API_URL",
    "PREFECT_API_AUTH_STRING",
    "PREFECT_HOME",
    "OPENTINKER_JOB_LIMITS",
    "OPENTINKER_SANDBOX",
    "OPENTINKER_SERVER_JOB_NICE",
    "OPENTINKER_S3_ENDPOINT_URL",
    "OPENTINKER_S3_BUCKET",
    "OPENTINKER_S3_ACCESS_KEY",
    "OPENTINKER_S3_SECRET_KEY",
    "OPENTINKER_S3_REGION",
)
"""What an attempt's trusted process inherits from the worker (Prefect's API, the operator's stores and settings)."""
PREFECT_POLL_S = 10.0
"""The longest a worker goes without polling Prefect while the server reports nothing new (a tenant's running-jobs
limit raised, the server unreachable); well inside Prefect's 60 s after which an unpolled queue shows not ready."""


class LaunchRefused(RuntimeError):
    """The server knows no unfinished job for this flow run."""


class SandboxWorker(OneSlotPerTakenRun, ProcessWorker):
    """``ProcessWorker`` whose runs are the server's job attempts, each in its bubblewrap sandbox."""

    type = "process"
    _description = "Runs OpenTinker server jobs in bubblewrap sandboxes."

    def __init__(self, *args: Any, server_url: str, worker_key: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.server_url = server_url.rstrip("/")
        self._key = worker_key
        if get_settings().sandbox == "bwrap":
            check_available()
        self.runtime = Path(tempfile.mkdtemp(prefix="opentinker-worker-"))
        self._seen: PendingWork | None = None
        self._next_poll = 0.0
        self._server = httpx.AsyncClient(
            base_url=self.server_url, headers={"Authorization": f"Bearer {worker_key}"}, timeout=5
        )

    async def __aexit__(self, *exc_info: Any) -> None:
        await self._server.aclose()
        await super().__aexit__(*exc_info)

    async def should_poll(self) -> bool:
        """When the server's pending work changed since the last poll (or ``PREFECT_POLL_S`` passed)."""
        pending = await self._pending()
        if pending == self._seen and time.monotonic() < self._next_poll:
            return False
        self._seen, self._next_poll = pending, time.monotonic() + PREFECT_POLL_S
        return True

    async def _pending(self) -> PendingWork | None:
        """The server's queued and running jobs; None when it does not answer (then Prefect is polled only every
        ``PREFECT_POLL_S``: no run could launch without the server anyway)."""
        try:
            answer = await self._server.get("/v1/internal/pending")
            answer.raise_for_status()
            return PendingWork.model_validate(answer.json())
        except (httpx.HTTPError, ValueError):
            return None

    def _launch(self, flow_run_id: str) -> LaunchInfo:
        answer = httpx.post(
            f"{self.server_url}/v1/internal/launches",
            json={"flow_run_id": flow_run_id, "host": socket.gethostname()},
            headers={"Authorization": f"Bearer {self._key}"},
            timeout=300,  # a tenant's first launch makes its MLflow store (schema migrations: seconds to a minute)
        )
        if answer.status_code == 404:
            raise LaunchRefused(f"flow run {flow_run_id}: no unfinished OpenTinker job; refusing to start it")
        answer.raise_for_status()
        return LaunchInfo.model_validate(answer.json())

    async def run(self, flow_run, configuration, task_status=None):
        import anyio.to_thread
        from prefect.states import Cancelled
        from prefect.workers.process import ProcessWorkerResult

        try:
            launch = await anyio.to_thread.run_sync(self._launch, str(flow_run.id))
        except LaunchRefused as refused:  # cancelled before it started, or not the server's: it never runs
            await self.client.set_flow_run_state(flow_run.id, Cancelled(message=str(refused)), force=True)
            if task_status is not None:
                task_status.started(refused)
            return ProcessWorkerResult(identifier="", status_code=0)
        launch = launch.model_copy(update={"server_url": self.server_url})
        env = {
            **base_env(),
            **{name: os.environ[name] for name in PASSED if name in os.environ},
            LAUNCH_VARIABLE: launch.model_dump_json(),
            SCRATCH_ROOT_VARIABLE: str(self.runtime),
            "PREFECT__FLOW_RUN_ID": str(flow_run.id),
            "OPENTINKER_JOB_ID": launch.job_id,
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S),
            "OPENTINKER_DATA_DIR": str(Path(launch.job_dir).parent.parent),
            "OPENTINKER_MLFLOW_TRACKING_URI": launch.tracking_uri,
            "OPENTINKER_MLFLOW_EXPERIMENT": launch.experiment,
        }
        if launch.tracking_username:  # the tenant's own MLflow user, never the operator's
            env.update(
                MLFLOW_TRACKING_USERNAME=launch.tracking_username, MLFLOW_TRACKING_PASSWORD=launch.tracking_password
            )
        env.update(launch.s3_env)  # the tenant's own S3 identity, in place of any the worker holds
        # The whole attempt at the job's niceness (its trusted side included: it is the job's work too), so the API,
        # Prefect and the worker answer first; the sandboxed child inherits it.
        configuration.command = shlex.join(("nice", "-n", str(get_settings().server_job_nice), *ATTEMPT_COMMAND))
        configuration.env = env
        return await super().run(flow_run, configuration, task_status)


def run_worker(server_url: str, worker_key: str, name: str | None = None, limit: int | None = None) -> None:
    """Run a worker of the server's pool until interrupted (``PREFECT_API_URL`` names the Prefect server)."""
    import anyio

    async def main() -> None:
        worker = SandboxWorker(
            work_pool_name=POOL, name=name, limit=limit, server_url=server_url, worker_key=worker_key
        )
        try:
            async with worker:
                await worker.start()
        finally:
            shutil.rmtree(worker.runtime, ignore_errors=True)

    os.environ.setdefault("PREFECT_WORKER_QUERY_SECONDS", str(WORKER_QUERY_SECONDS))
    anyio.run(main)
