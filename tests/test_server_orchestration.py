"""The server's side of Prefect against a real Prefect server: the job sync reads any number of flow runs (Prefect
answers at most 200 per read); a queue's concurrency limit holds even when a run the worker took has not yet left
Scheduled and a higher-priority run arrives in that moment (Prefect counts only Pending and Running runs against the
limit, so a poll then would be handed the same slot again); an idle worker does not poll Prefect, whose every poll is
a write to its database, yet takes a new job at once; and whoever reaches Prefect's API runs nothing through it."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import datetime

import httpx
import pytest
from fixtures.server import wait_for_job
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.actions import DeploymentUpdate

from opentinker.server.orchestration import POOL, PREFECT_PAGE, Orchestrator
from opentinker.server.worker import PREFECT_POLL_S, SandboxWorker

pytestmark = pytest.mark.slow

TENANT = "worker-limit"
FINAL = ("CANCELLED", "COMPLETED", "FAILED", "CRASHED")


class HeldWorker(SandboxWorker):
    """The server's worker with two holds, to pin the moment under test: a taken run's Pending waits for
    ``release``; a started run holds its slot (no process) until ``done``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.release, self.done = asyncio.Event(), asyncio.Event()

    async def before_pending(self, flow_run) -> None:
        await self.release.wait()

    async def run(self, flow_run, configuration, task_status=None):
        from prefect.workers.process import ProcessWorkerResult

        if task_status is not None:
            task_status.started(0)
        await self.done.wait()
        return ProcessWorkerResult(identifier="0", status_code=0)


@pytest.fixture
def orchestrator(prefect_server):
    orchestrator = Orchestrator(prefect_server)
    orchestrator.setup()
    try:
        yield orchestrator
    finally:
        orchestrator.close()


def test_the_sync_reads_more_flow_runs_than_one_prefect_page(orchestrator, monkeypatch):
    from prefect.exceptions import PrefectHTTPStatusError

    with pytest.raises(PrefectHTTPStatusError, match="422"):  # the page is Prefect's own limit
        orchestrator.client.read_flow_runs(limit=PREFECT_PAGE + 1)
    monkeypatch.setattr("opentinker.server.orchestration.PREFECT_PAGE", 2)
    orchestrator.ensure_queue("many", 0)  # nothing of it starts
    ids = [orchestrator.submit(f"job-{n}", 1, "many", 0, time.time()) for n in range(5)]
    read, limits = orchestrator.client.read_flow_runs, []
    monkeypatch.setattr(orchestrator.client, "read_flow_runs", lambda **kw: limits.append(kw["limit"]) or read(**kw))
    runs = orchestrator.flow_runs([*ids, str(uuid.uuid4())])
    assert limits == [2, 2, 2]
    assert sorted(runs) == sorted(ids)  # the unknown id left out
    assert {run.state.type.value for run in runs.values()} == {"SCHEDULED"}


def test_a_run_taken_but_not_yet_pending_keeps_its_slot_from_a_later_higher_priority_run(
    prefect_server, orchestrator, monkeypatch
):
    monkeypatch.setenv("PREFECT_API_URL", prefect_server)
    monkeypatch.setattr("opentinker.server.worker.PREFECT_POLL_S", 0)  # every call polls (no server to ask here)
    orchestrator.ensure_queue(TENANT, 1)

    def state(run_id: str) -> str:
        return orchestrator.client.read_flow_run(uuid.UUID(run_id)).state.type.value

    async def scenario() -> tuple[list[str], list[str], list[str], str]:
        worker = HeldWorker(work_pool_name=POOL, server_url="http://127.0.0.1:9", worker_key="unused")
        async with worker:
            low = orchestrator.submit("job-low", 1, TENANT, priority=0, submitted_at=time.time())
            first = [str(run.id) for run in await worker.get_and_submit_flow_runs()]
            assert first == [low] and state(low) == "SCHEDULED"  # taken; its Pending not proposed yet
            high = orchestrator.submit("job-high", 1, TENANT, priority=5, submitted_at=time.time())
            second = [str(run.id) for run in await worker.get_and_submit_flow_runs()]
            worker.release.set()
            for _ in range(100):
                if state(low) == "PENDING":
                    break
                await asyncio.sleep(0.1)
            third = [str(run.id) for run in await worker.get_and_submit_flow_runs()]
            states = [state(low), state(high)]
            worker.done.set()
        for run_id in (low, high):
            orchestrator.cancel(run_id)
        return second, third, states, high

    from prefect.logging.handlers import APILogHandler
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server}):
        second, third, states, high = asyncio.run(scenario())
        APILogHandler().flush()  # the worker's run logs, to this server
    assert high not in second, "a poll while the taken run is still Scheduled is handed its slot again"
    assert high not in third, "the limit of 1 is taken by the first run, now Pending"
    assert states == ["PENDING", "SCHEDULED"]


def test_an_idle_worker_does_not_poll_prefect_and_still_takes_a_new_job_at_once(job_server):
    """Each Prefect poll marks the pool's queues polled (a write): twice a second on the embedded SQLite, those
    writes made a submit's ``create_flow_run`` fail on the write lock and wait out the client's 2 s retry."""
    server = job_server
    api = f"{server.prefect_url}/api"

    def last_polled() -> set[str]:
        queues = httpx.post(f"{api}/work_pools/{POOL}/queues/filter", json={}, timeout=30).json()
        return {queue["last_polled"] for queue in queues if queue["last_polled"]}

    seen: set[str] = set()
    for _ in range(16):  # 4 s at 0.25 s: a worker polling Prefect every 0.5 s marks the queues 8 times
        seen |= last_polled()
        time.sleep(0.25)
    assert len(seen) <= 2, f"the idle worker polled Prefect {len(seen)} times in 4 s"

    key = server.make_key("idle-worker")
    headers = server.headers(key)
    job = httpx.post(f"{server.url}/v1/jobs", headers=headers, json={"spec": {"env_id": "CartPole-v1", "steps": 10**6}})
    assert job.status_code == 201, job.text
    running = wait_for_job(server, key, job.json()["id"], lambda status: status["state"] == "RUNNING", timeout=120)
    httpx.post(f"{server.url}/v1/jobs/{job.json()['id']}/cancel", headers=headers, timeout=30)
    flow_run = httpx.get(f"{api}/flow_runs/{running['flow_run_id']}", timeout=30).json()
    states = httpx.get(f"{api}/flow_run_states/", params={"flow_run_id": flow_run["id"]}, timeout=30).json()
    pending = min(datetime.fromisoformat(state["timestamp"]) for state in states if state["type"] == "PENDING")
    taken_s = (pending - datetime.fromisoformat(flow_run["created"])).total_seconds()
    assert taken_s < PREFECT_POLL_S / 2, f"the worker took the new run after {taken_s:.1f} s, not on the server's word"


def test_a_flow_run_made_behind_the_servers_back_and_an_edited_deployment_run_nothing(job_server, tmp_path):
    """Whoever reaches Prefect's API (it has no tenants) edits the deployment every job loads, its pull steps and
    command, and makes a flow run of its own: a stock process worker would run that command. The server's worker
    refuses the run (no job of the server has it) and its attempts run code fixed in the worker, not the
    deployment's: nothing of the attacker's runs, and the next job of a tenant trains as before."""
    server = job_server
    marker = tmp_path / "attacker-ran"
    script = f"touch {marker}"
    edited = DeploymentUpdate(
        pull_steps=[{"prefect.deployments.steps.run_shell_script": {"script": script}}],
        job_variables={"command": script},
    )
    # Prefect's own client: on the embedded SQLite a write can meet another's snapshot and answer 503, which
    # Prefect's API documents as retryable and its client retries.
    with SyncPrefectClient(f"{server.prefect_url}/api") as prefect:
        deployment = prefect.read_deployment_by_name("train/jobs")
        original = DeploymentUpdate(pull_steps=deployment.pull_steps, job_variables=deployment.job_variables)
        prefect.update_deployment(deployment.id, edited)
        try:
            made = prefect.create_flow_run_from_deployment(deployment.id, parameters={"job_id": "job-x"})
            deadline, run = time.monotonic() + 120, made
            while run.state.type.value not in FINAL and time.monotonic() < deadline:
                time.sleep(0.5)
                run = prefect.read_flow_run(made.id)
            assert run.state.type.value == "CANCELLED", run.state
            assert "no unfinished OpenTinker job" in run.state.message

            key = server.make_key("behind-the-back")
            headers = server.headers(key)
            spec = {"env_id": "CartPole-v1", "steps": 2048}
            job = httpx.post(f"{server.url}/v1/jobs", headers=headers, json={"spec": spec}, timeout=120)
            assert job.status_code == 201, job.text
            wait_for_job(server, key, job.json()["id"], lambda status: status["state"] == "SUCCEEDED")
        finally:
            prefect.update_deployment(deployment.id, original)
    assert not marker.exists(), "the attacker's pull step or command ran"
