"""The two things the server needs that Prefect's public API does not offer, kept here and nowhere else.

Both lean on Prefect's private parts (names starting with ``_``, ``prefect._internal``) as of the locked Prefect;
``tests/test_prefect_private.py`` fails on a Prefect where any of them moved, and no other module of the tree may
name them (the same test). docs/service.md ("Prefect's private parts") says why each is needed.

1. ``OneSlotPerTakenRun``: a worker takes a run, then proposes its Pending state; until then Prefect does not count
   the run against the pool's and queues' limits, so a poll in between is handed the same slot again (3 running
   jobs for a tenant limit of 2, seen in ``bench/service.py`` (d) on PostgreSQL). Public workers have no hook
   between taking a run and its Pending, so the mixin watches ``_submitting_flow_run_ids`` and
   ``_propose_pending_state``.
2. ``run_flow_run``: what ``python -m prefect.engine`` does for a flow run, called from the attempt's own entry
   point, so the attempt's sandboxed child starts before Prefect's start-up (their start-ups overlap) and the flow
   run then adopts it. The engine module's ``__main__`` offers no hook for that; the control listener it
   configures is how the worker's cancellation reaches the run.
"""

from __future__ import annotations

import uuid
from typing import Any


class OneSlotPerTakenRun:
    """For a process worker (``class W(OneSlotPerTakenRun, ProcessWorker)``; a mixin, so Prefect's registry of worker
    types sees only ``W``): poll again only once every run it took has left Scheduled (its Pending proposed), and
    only when ``should_poll()`` says there may be something new."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._taken: set[uuid.UUID] = set()
        """Runs handed to this worker that have not left Scheduled yet (their Pending not yet proposed)."""

    async def should_poll(self) -> bool:
        """Whether to ask Prefect for runs now (subclasses skip polls that could find nothing)."""
        return True

    async def get_and_submit_flow_runs(self):
        self._taken &= self._submitting_flow_run_ids  # a submission that ended before its Pending holds nothing
        if self._taken or not await self.should_poll():
            return []
        before = set(self._submitting_flow_run_ids)
        runs = await super().get_and_submit_flow_runs()
        self._taken |= self._submitting_flow_run_ids - before
        return runs

    async def before_pending(self, flow_run) -> None:
        """Called as a taken run's Pending is about to be proposed: the moment the slot is still uncounted."""

    async def _propose_pending_state(self, flow_run) -> bool:
        try:
            await self.before_pending(flow_run)
            return await super()._propose_pending_state(flow_run)
        finally:
            self._taken.discard(flow_run.id)


def run_flow_run(flow: Any, flow_run_id: uuid.UUID) -> None:
    """Run the flow run ``flow_run_id`` of ``flow`` in this process, as Prefect's engine entry point does."""
    from prefect._internal.control_listener import configure_from_env
    from prefect.engine import handle_engine_signals
    from prefect.flow_engine import flow_run_logger, load_flow_run, run_flow

    configure_from_env()
    with handle_engine_signals(flow_run_id):
        flow_run = load_flow_run(flow_run_id=flow_run_id)
        run_flow(
            flow,
            flow_run=flow_run,
            parameters=dict(flow_run.parameters),
            error_logger=flow_run_logger(flow_run=flow_run),
        )
