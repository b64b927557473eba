"""The server's uses of Prefect's private parts live in ``opentinker/server/prefect_private.py`` alone, and the
locked Prefect still has each of them: a Prefect upgrade that moves one fails here, naming it, instead of silently
double-booking a queue's slot or leaving cancellations unheard. (Their behaviour is tested against a real Prefect
server in tests/test_server_orchestration.py and by every job of the server's tests.)"""

from __future__ import annotations

import asyncio
import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRIVATE = re.compile(r"prefect\._internal|_propose_pending_state|_submitting_flow_run_ids")
HOME = ROOT / "opentinker" / "server" / "prefect_private.py"


def test_the_private_parts_the_server_uses_are_still_there():
    from prefect._internal.control_listener import configure_from_env
    from prefect.engine import handle_engine_signals
    from prefect.flow_engine import flow_run_logger, load_flow_run, run_flow
    from prefect.workers.process import ProcessWorker

    for function in (configure_from_env, handle_engine_signals, flow_run_logger, load_flow_run, run_flow):
        assert callable(function), function
    propose = ProcessWorker._propose_pending_state
    assert inspect.iscoroutinefunction(propose) and list(inspect.signature(propose).parameters) == ["self", "flow_run"]
    assert list(inspect.signature(load_flow_run).parameters) == ["flow_run_id"]
    assert {"flow_run", "parameters", "error_logger"} <= set(inspect.signature(run_flow).parameters)
    worker = ProcessWorker(work_pool_name="never-started")
    assert isinstance(worker._submitting_flow_run_ids, set)
    assert asyncio.iscoroutinefunction(ProcessWorker.get_and_submit_flow_runs)


def test_no_other_module_names_them():
    named = [
        str(path.relative_to(ROOT))
        for folder in (
            "opentinker",
            "flows",
            "tasks",
            "envs",
            "agents",
            "federated",
            "serving",
            "infra",
            "bench",
            "tests",
        )
        for path in (ROOT / folder).rglob("*.py")
        if path not in (HOME, Path(__file__).resolve()) and PRIVATE.search(path.read_text())
    ]
    assert named == [], f"Prefect's private parts belong in {HOME.relative_to(ROOT)} only: {named}"
