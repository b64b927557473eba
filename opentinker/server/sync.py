"""Job states follow their flow runs: a thread reads the unfinished jobs' flow runs from Prefect four times a second.

Prefect state → job state: Scheduled → QUEUED (AwaitingRetry, a flow retry in progress, stays RUNNING); Pending (a
worker took it, its process starts) and Running → RUNNING; Completed → SUCCEEDED, with the result the attempt reported
(``launches.record_result``); Failed → FAILED with Prefect's message; Cancelled → CANCELLED. Crashed (the flow-run
process died: killed, out of memory, its worker gone; a run whose process on this host is gone is marked so here)
queues the job's next attempt as a new flow run, up to ``MAX_ATTEMPTS`` attempts: it resumes from the last checkpoint,
and a late report about the crashed run cannot touch it. Every server process may run this loop; each change is a
compare-and-set on the job's row, so two of them never apply the same change twice.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
import sqlalchemy as sa

from .db import Job, Store
from .orchestration import Orchestrator
from .schemas import FINAL_STATES

MAX_ATTEMPTS = 3
INTERVAL_S = 0.25
GONE_GRACE_S = 5.0
"""How long a running flow run's process must be gone before the server marks the run Crashed itself."""
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")
"""Prefect state types of a flow run that has stopped running."""
logger = logging.getLogger("opentinker.server")


class JobSync:
    def __init__(
        self,
        store: Store,
        orchestrator: Orchestrator,
        settings,
        hand_off: Callable[[Job], None],
        interval_s: float = INTERVAL_S,
    ):
        """``hand_off(job)``: have the flow run of the job's current attempt made (``JobBoard.hand_off_later``)."""
        self.store = store
        self.orchestrator = orchestrator
        self.settings = settings
        self.hand_off = hand_off
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._gone_since: dict[str, float] = {}
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="job-sync", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.run_once()
            except Exception:  # Prefect or the database briefly unreachable: try again next round
                logger.exception("job sync failed; retrying")

    def run_once(self) -> None:
        with self.store.session() as session:
            jobs = list(session.scalars(sa.select(Job).where(Job.state.in_(("QUEUED", "RUNNING")))))
        # Queued jobs' runs are read before running jobs' runs (the reads may take several pages): a run seen
        # started took a slot that the later read already shows ended. Ends are then applied before starts, so a
        # job that ended and the one that took its slot never show as running together (an ended job's result
        # read from MLflow takes a moment).
        runs = {}
        for state in ("QUEUED", "RUNNING"):
            runs |= self.orchestrator.flow_runs(
                [job.flow_run_id for job in jobs if job.flow_run_id and job.state == state]
            )
        followed = [(job, runs[job.flow_run_id]) for job in jobs if job.flow_run_id in runs]
        followed.sort(key=lambda pair: pair[1].state is None or pair[1].state.type.value not in ENDED)
        for job, run in followed:
            if run.state is not None:
                self._follow(job, run)

    def _follow(self, job: Job, run: Any) -> None:
        state, name, message = run.state.type.value, run.state.name, run.state.message or ""
        changes: dict[str, Any] = {}
        if state == "SCHEDULED" and job.cancel_requested:  # cancelled before its flow run existed
            self.orchestrator.cancel(job.flow_run_id)
        elif state == "SCHEDULED" and name != "AwaitingRetry":
            if job.state != "QUEUED":
                changes = {"state": "QUEUED", "phase": ""}
        elif state == "CANCELLING" and not run.infrastructure_pid and self._waited(job.flow_run_id):
            # Cancelled between its Pending and its process's start: Prefect's runner then starts no process and
            # leaves the run Cancelling, holding its tenant's slot; no process of it exists to stop.
            self.orchestrator.cancelled(job.flow_run_id, "cancelled before its process started")
        elif state in ("RUNNING", "CANCELLING") and self._process_gone(job, run):
            self.orchestrator.crash(
                job.flow_run_id, f"its process {run.infrastructure_pid} on {job.launch_host} is gone"
            )
        elif state in ("PENDING", "RUNNING", "CANCELLING") or (state == "SCHEDULED" and name == "AwaitingRetry"):
            phase = {"PENDING": "starting", "CANCELLING": "cancelling", "SCHEDULED": "retrying"}.get(state, "running")
            changes = {"state": "RUNNING", "phase": phase}
            if job.started_at is None:
                changes["started_at"] = time.time()
        elif state == "COMPLETED":
            changes = self._after_completion(job)
        elif state == "CANCELLED":
            changes = {"state": "CANCELLED", "ended_at": time.time(), "reason": message or "cancelled"}
        elif state == "FAILED":
            changes = {"state": "FAILED", "ended_at": time.time(), "reason": message or "failed"}
        elif state == "CRASHED":
            changes = self._after_crash(job, message)
        if changes and any(getattr(job, key) != value for key, value in changes.items()):
            self._apply(job, changes)

    def _process_gone(self, job: Job, run: Any) -> bool:
        """Whether the run's process was started on this host and has been gone for ``GONE_GRACE_S`` (its worker
        died with it). A live worker reports its own run Crashed within a second: the grace leaves that to it."""
        if job.launch_host != socket.gethostname() or not (run.infrastructure_pid or "").isdigit():
            return False
        if psutil.pid_exists(int(run.infrastructure_pid)):
            self._gone_since.pop(job.flow_run_id, None)
            return False
        first_seen = self._gone_since.setdefault(job.flow_run_id, time.monotonic())
        if time.monotonic() - first_seen < GONE_GRACE_S:
            return False
        del self._gone_since[job.flow_run_id]
        return True

    def _waited(self, flow_run_id: str) -> bool:
        """Whether this loop has seen ``flow_run_id`` in its present condition for ``GONE_GRACE_S`` (a worker in the
        middle of starting the run reports its own)."""
        first_seen = self._gone_since.setdefault(flow_run_id, time.monotonic())
        if time.monotonic() - first_seen < GONE_GRACE_S:
            return False
        del self._gone_since[flow_run_id]
        return True

    def _after_crash(self, job: Job, message: str) -> dict[str, Any]:
        if job.cancel_requested:
            return {"state": "CANCELLED", "ended_at": time.time(), "reason": "cancelled"}
        if job.attempts >= MAX_ATTEMPTS:
            return {"state": "FAILED", "ended_at": time.time(), "reason": f"crashed {job.attempts} times: {message}"}
        changes = {"attempts": job.attempts + 1, "state": "QUEUED", "reason": f"re-queued: {message}"}
        if self._apply(job, {**changes, "flow_run_id": None, "phase": ""}):
            with self.store.session() as session:
                self.hand_off(session.get(Job, job.id))
        return {}

    def _apply(self, job: Job, changes: dict[str, Any]) -> bool:
        """Compare-and-set: apply ``changes`` only if the row is as this loop read it (same state and attempt)."""
        with self.store.session() as session:
            updated = session.execute(
                sa.update(Job)
                .where(Job.id == job.id, Job.state == job.state, Job.attempts == job.attempts)
                .where(Job.state.not_in(FINAL_STATES))
                .values(**changes, updated_at=time.time())
            ).rowcount
        return bool(updated)

    def _after_completion(self, job: Job) -> dict[str, Any]:
        """SUCCEEDED with the result the attempt reported (stored on the job before its flow run completed)."""
        with self.store.session() as session:
            result = session.get(Job, job.id).result
        if not result:
            return {"state": "FAILED", "ended_at": time.time(), "reason": "the attempt completed without a result"}
        return {"state": "SUCCEEDED", "ended_at": time.time(), "reason": ""}
