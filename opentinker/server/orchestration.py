"""Prefect runs and queues the jobs: one process work pool, one work queue per tenant, one flow run per job attempt.

- **Queues.** A tenant's queue (``tenants.work_queue``) has the tenant's running-jobs quota as its concurrency limit:
  Prefect hands a worker no more of its runs than that (it counts Pending and Running runs), so a tenant over its
  limit waits in its queue and other tenants' runs go ahead.
- **Priorities.** Within a queue Prefect starts the runs whose scheduled time is earliest. A job of priority ``p``
  is scheduled ``p`` days before it was submitted, so a higher priority goes first and equal priorities go first in,
  first out. (The Prefect UI therefore shows a prioritised run as "Late".)
- **Pickup.** The server's workers ask the server every ``WORKER_QUERY_SECONDS`` what is queued and running, and
  poll Prefect when that changed (``worker.py``): a job starts within a second of its submit, and an idle worker
  does not write to Prefect's database twice a second.
- **Cluster capacity** is the pool's concurrency limit (None: the workers' own limits).
- **Lost runs.** A job's flow run sends Prefect a heartbeat event every ``HEARTBEAT_S``; Prefect's automation
  ``ZOMBIES`` (a proactive trigger, Prefect's documented zombie detection) marks a run whose heartbeats stopped
  Crashed, so a run whose worker machine died, or whose server went down with its worker, is not Running forever:
  the server re-queues it and it resumes from its last checkpoint. On the server's own machine the sync loop does
  not wait for that: a run whose process (Prefect's ``infrastructure_pid``) is gone is Crashed at once.
"""

from __future__ import annotations

import datetime
import uuid
from pathlib import Path
from typing import Any

from opentinker.flows.work_pool import SOURCE_ROOT

from . import tenants

POOL = "opentinker-jobs"
DEPLOYMENT = "jobs"
FLOW = "train"
ENTRYPOINT = f"{Path(__file__).resolve().with_name('attempt.py').relative_to(SOURCE_ROOT)}:job_attempt"
"""``attempt.py`` from ``SOURCE_ROOT``: ``opentinker/server/attempt.py`` in a checkout, ``server/attempt.py`` installed
(where ``SOURCE_ROOT`` is the ``opentinker`` package folder)."""
PRIORITY_STEP = datetime.timedelta(days=1)
WORKER_QUERY_SECONDS = 0.5
"""``PREFECT_WORKER_QUERY_SECONDS`` of the server's workers (Prefect's default: 15): how often they ask the server."""
HEARTBEAT_S = 30
"""``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` of a job's flow run (Prefect's minimum): a heartbeat event this often."""
HEARTBEAT_LOST_S = 90
"""A running flow run whose heartbeats stop this long is marked Crashed (``ZOMBIES``), then re-queued."""
ZOMBIES = "opentinker: crash flow runs that lost their heartbeat"
PREFECT_PAGE = 200
"""The most objects Prefect's API answers in one read (``PREFECT_API_DEFAULT_LIMIT``; a larger ``limit`` is a 422)."""


class Orchestrator:
    """The server's handle on Prefect: its work pool, the tenants' queues and the jobs' flow runs."""

    def __init__(self, api_url: str):
        from prefect.client.orchestration import SyncPrefectClient

        self.api_url = api_url
        self.client = SyncPrefectClient(api_url)
        self.client.__enter__()
        self.deployment_id: uuid.UUID | None = None
        self._queues: dict[str, int | None] = {}

    def close(self) -> None:
        self.client.__exit__(None, None, None)

    def setup(self, pool_limit: int | None = None) -> None:
        """The work pool (created if missing; ``pool_limit`` is the cluster's capacity in jobs) and the deployment
        every job runs (``flow train``, entrypoint ``ENTRYPOINT`` in this source tree)."""
        from prefect import Flow
        from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
        from prefect.exceptions import ObjectAlreadyExists

        try:
            self.client.create_work_pool(WorkPoolCreate(name=POOL, type="process", concurrency_limit=pool_limit))
        except ObjectAlreadyExists:
            self.client.update_work_pool(POOL, WorkPoolUpdate(concurrency_limit=pool_limit))
        from prefect.settings import PREFECT_API_URL, temporary_settings

        self.ensure_zombie_detection()
        with temporary_settings({PREFECT_API_URL: self.api_url}):
            flow = Flow.from_source(source=str(SOURCE_ROOT), entrypoint=ENTRYPOINT)
            self.deployment_id = flow.deploy(
                name=DEPLOYMENT,
                work_pool_name=POOL,
                build=False,
                push=False,
                print_next_steps=False,
                ignore_warnings=True,
                description="OpenTinker server jobs: each flow run is one attempt of one job (docs/service.md).",
            )

    def ensure_zombie_detection(self) -> None:
        """The automation that marks a flow run Crashed once its heartbeats stop (made once per Prefect server)."""
        from prefect.client.schemas.objects import StateType
        from prefect.events.actions import ChangeFlowRunState
        from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

        if self.client.read_automations_by_name(ZOMBIES):
            return
        final = ("Completed", "Failed", "Cancelled", "Crashed")
        trigger = EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{state}" for state in final)},
            match={"prefect.resource.id": ["prefect.flow-run.*"]},
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=datetime.timedelta(seconds=HEARTBEAT_LOST_S),
        )
        action = ChangeFlowRunState(state=StateType.CRASHED, message=f"no heartbeat for {HEARTBEAT_LOST_S} s")
        self.client.create_automation(AutomationCore(name=ZOMBIES, trigger=trigger, actions=[action]))

    def ensure_queue(self, tenant: str, concurrency_limit: int | None) -> None:
        """The tenant's work queue in the pool, with its running-jobs quota as concurrency limit."""
        from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

        name = tenants.work_queue(tenant)
        if self._queues.get(name, -1) == concurrency_limit:
            return
        try:
            self.client.create_work_queue(
                name=name,
                work_pool_name=POOL,
                concurrency_limit=concurrency_limit,
                description=f"Jobs of tenant {tenant}",
            )
        except ObjectAlreadyExists:
            try:
                queue = self.client.read_work_queue_by_name(name, work_pool_name=POOL)
            except ObjectNotFound:  # pragma: no cover - created and deleted between the two calls
                raise
            self.client.update_work_queue(queue.id, concurrency_limit=concurrency_limit)
        self._queues[name] = concurrency_limit

    def submit(self, job_id: str, attempt: int, tenant: str, priority: int, submitted_at: float) -> str:
        """A scheduled flow run for one attempt of a job, in the tenant's queue (idempotent per job and attempt)."""
        from prefect.states import Scheduled

        when = datetime.datetime.fromtimestamp(submitted_at, datetime.UTC) - priority * PRIORITY_STEP
        flow_run = self.client.create_flow_run_from_deployment(
            self.deployment_id,
            parameters={"job_id": job_id},
            state=Scheduled(scheduled_time=when),
            name=job_id if attempt == 1 else f"{job_id}-{attempt}",
            tags=[f"tenant:{tenant}", f"job:{job_id}"],
            idempotency_key=f"{job_id}/{attempt}",
            work_queue_name=tenants.work_queue(tenant),
        )
        return str(flow_run.id)

    def flow_runs(self, ids: list[str]) -> dict[str, Any]:
        """The flow runs with these ids (missing ones left out)."""
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        found = {}
        for start in range(0, len(ids), PREFECT_PAGE):
            page = [uuid.UUID(i) for i in ids[start : start + PREFECT_PAGE]]
            runs = self.client.read_flow_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=page)), limit=len(page)
            )
            found.update((str(run.id), run) for run in runs)
        return found

    def cancel(self, flow_run_id: str) -> None:
        """Cancel a run: a scheduled one at once, a running one through its worker (which stops its process)."""
        from prefect.states import Cancelled, Cancelling

        run = self.client.read_flow_run(uuid.UUID(flow_run_id))
        state = (
            Cancelling() if run.state is not None and run.state.type.value in ("PENDING", "RUNNING") else Cancelled()
        )
        self.client.set_flow_run_state(uuid.UUID(flow_run_id), state, force=True)

    def cancelled(self, flow_run_id: str, message: str) -> None:
        """Mark a Cancelling run whose process never started Cancelled (what its worker would have reported)."""
        from prefect.states import Cancelled

        self.client.set_flow_run_state(uuid.UUID(flow_run_id), Cancelled(message=message), force=True)

    def crash(self, flow_run_id: str, message: str) -> None:
        """Mark a run whose process is gone Crashed (what Prefect's worker reports when it sees its process die)."""
        from prefect.states import Crashed

        self.client.set_flow_run_state(uuid.UUID(flow_run_id), Crashed(message=message), force=True)

    def logs(self, flow_run_id: str, offset: int, limit: int = 200) -> list[Any]:
        """The flow run's log lines (flow and task runs), oldest first."""
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        return self.client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[uuid.UUID(flow_run_id)])),
            offset=offset,
            limit=limit,
        )

    def workers_online(self) -> int:
        """Workers of the pool whose last heartbeat is recent (Prefect marks the others offline)."""
        return sum(1 for worker in self.client.read_workers_for_work_pool(POOL) if worker.status.value == "ONLINE")

    def pool_limit(self) -> int | None:
        return self.client.read_work_pool(POOL).concurrency_limit

    def flow_run_url(self, flow_run_id: str) -> str:
        return f"{self.api_url.removesuffix('/api')}/runs/flow-run/{flow_run_id}"
