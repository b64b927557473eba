"""The server's Prefect worker: Prefect's own process worker, whose every run starts in the job's sandbox.

``opentinker server worker`` (and ``server up``, for its embedded worker) runs it: it polls the work pool twice a
second (``PREFECT_WORKER_QUERY_SECONDS``), respects the pool's and queues' concurrency limits and cancels runs as
Prefect's process worker does. Only the command differs, and it is fixed in code, not taken from the pool's job
template: before a run starts, the worker asks the server for that run's launch (``launches.py``), then starts
``python -m opentinker.server.job_entry`` inside the sandbox the launch describes. A run the server does not know
is refused, so nothing else reaching Prefect's API can make this worker run a command. With the embedded stack the
sandbox has no network: the worker's ``JobProxy`` (one Unix socket, bound into every sandbox) is its way to Prefect.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
from prefect.workers.process import ProcessWorker

from opentinker.infra.settings import get_settings

from .job_proxy import PROGRESS_PATH, PROXY_PORT, Attempt, JobProxy
from .orchestration import HEARTBEAT_S, POOL, WORKER_QUERY_SECONDS
from .sandbox import Sandbox, base_env, check_available, write_seccomp_program
from .schemas import LaunchInfo

JOB_COMMAND = (sys.executable, "-m", "opentinker.server.job_entry")
SANDBOX_PROXY_DIR = "/run/opentinker"
"""Where a job's sandbox finds the proxy's socket."""


class LaunchRefused(RuntimeError):
    """The server knows no unfinished job for this flow run."""


class SandboxWorker(ProcessWorker):
    """``ProcessWorker`` whose runs are the server's job attempts, each in its bubblewrap sandbox."""

    type = "process"
    _description = "Runs OpenTinker server jobs in bubblewrap sandboxes."

    def __init__(self, *args: Any, server_url: str, worker_key: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.server_url = server_url.rstrip("/")
        self._key = worker_key
        self._sandboxed = get_settings().sandbox == "bwrap"
        self._nice = ("nice", "-n", str(get_settings().server_job_nice))
        self.runtime = Path(tempfile.mkdtemp(prefix="opentinker-worker-"))
        self._proxy = None
        if self._sandboxed:
            check_available()
            self._seccomp = write_seccomp_program(self.runtime / "seccomp.bpf")
            (self.runtime / "proxy").mkdir(mode=0o755)
            self._proxy = JobProxy(self.runtime / "proxy" / "api.sock", os.environ["PREFECT_API_URL"], self.server_url)
            self._proxy.start()
        self._taken: set[UUID] = set()
        """Runs handed to this worker that have not left Scheduled yet (their Pending not yet proposed)."""

    async def get_and_submit_flow_runs(self):
        """Poll only once every run taken at earlier polls has left Scheduled. Prefect counts a queue's and the
        pool's Pending and Running runs against their limits, so a poll while a taken run is still Scheduled is
        handed its slot a second time: a higher-priority run submitted in between started as well (3 running jobs
        for a tenant limit of 2 in ``bench/service.py`` (d) on PostgreSQL)."""
        self._taken &= self._submitting_flow_run_ids  # a submission that ended before its Pending holds nothing
        if self._taken:
            return []
        before = set(self._submitting_flow_run_ids)
        runs = await super().get_and_submit_flow_runs()
        self._taken |= self._submitting_flow_run_ids - before
        return runs

    async def _propose_pending_state(self, flow_run) -> bool:
        try:
            return await super()._propose_pending_state(flow_run)
        finally:
            self._taken.discard(flow_run.id)

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
        env = {
            **launch.env,
            "PREFECT__FLOW_RUN_ID": str(flow_run.id),
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S),
            "OPENTINKER_JOB_ID": launch.job_id,
            "OPENTINKER_JOB_TOKEN": launch.token,
        }
        isolated = self._sandboxed and launch.isolated
        if isolated:  # no network: Prefect and progress through the proxy, which knows this attempt by its token
            env.update(
                PREFECT_API_URL=f"http://127.0.0.1:{PROXY_PORT}/api",
                PREFECT_API_AUTH_STRING=launch.token,
                OPENTINKER_JOB_PROXY=f"{SANDBOX_PROXY_DIR}/api.sock",
                OPENTINKER_JOB_REPORT_URL=f"http://127.0.0.1:{PROXY_PORT}{PROGRESS_PATH}",
            )
            self._proxy.admit(launch.token, Attempt(launch.job_id, str(flow_run.id)))
        else:
            env.update(
                PREFECT_API_URL=os.environ["PREFECT_API_URL"],
                OPENTINKER_JOB_REPORT_URL=f"{self.server_url}/v1/internal/jobs/{launch.job_id}/progress",
            )
        if self._sandboxed:
            box = Sandbox(
                writable=tuple(map(Path, launch.writable)),
                readonly=tuple(map(Path, launch.readonly)),
                binds=((self.runtime / "proxy", Path(SANDBOX_PROXY_DIR)),) if isolated else (),
                env=env,
                network=not isolated,
            )
            configuration.command = shlex.join((*self._nice, *box.shell_command(JOB_COMMAND, self._seccomp)))
            configuration.env = {"PATH": "/usr/bin:/bin"}
        else:  # OPENTINKER_SANDBOX=none: trusted tenants only (docs/service.md)
            configuration.command = shlex.join((*self._nice, *JOB_COMMAND))
            configuration.env = {**base_env(), **env}
        try:
            return await super().run(flow_run, configuration, task_status)
        finally:
            if isolated:
                self._proxy.dismiss(launch.token)


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
