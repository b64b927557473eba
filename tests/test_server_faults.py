"""Faults on a real `opentinker server up`: the server killed with SIGKILL mid-job, a job's process killed, a client
that goes away, a cancel — each job ends with nothing lost, and a resumed job with the same final weights as an
uninterrupted one (the engine's bit-exact resume)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
from fixtures.server import wait_for_job

pytestmark = pytest.mark.slow

SPEC = {
    "env_id": "CartPole-v1",
    "steps": 24576,
    "seed": 3,
    "num_envs": 8,
    "checkpoint_every": 1024,
    "eval_episodes": 2,
    "champion_threshold": 0.0,
    "ppo": {"n_steps": 32},
}
"""Checkpoints every few iterations, so a kill always leaves one behind."""
HTTP = httpx.Client(timeout=120)
FINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


def _job_processes(job_id: str) -> dict[psutil.Process, str]:
    """The host's processes of one job (its sandbox gives them ``OPENTINKER_JOB_ID``; Ray's inherit it), with their
    command lines, read at once: a process of the job may exit (its training child, a Ray worker) between being
    listed and being asked for its command line."""
    found = {}
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("OPENTINKER_JOB_ID") == job_id:
                found[proc] = " ".join(proc.cmdline())
        except (psutil.Error, OSError):
            continue
    return found


def _left_after(job_id: str, seconds: float) -> dict[psutil.Process, str]:
    """The job's processes still there after up to ``seconds``: a killed or cancelled process tree ends
    asynchronously (signals are delivered, a parent-death signal follows its parent's exit, Ray's workers follow
    their raylet)."""
    deadline = time.monotonic() + seconds
    while (left := _job_processes(job_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _weights(server, key: str, job_id: str) -> dict[str, np.ndarray]:
    archive = HTTP.get(f"{server.url}/v1/jobs/{job_id}/policy", headers=server.headers(key))
    assert archive.status_code == 200, archive.text
    with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
        data = tar.extractfile("weights.npz").read()
    with np.load(io.BytesIO(data)) as weights:
        return {name: weights[name] for name in weights.files}


def _submit(server, key: str) -> str:
    answer = HTTP.post(f"{server.url}/v1/jobs", headers=server.headers(key), json={"spec": SPEC})
    assert answer.status_code == 201, answer.text
    return answer.json()["id"]


def _training(status: dict) -> bool:
    progress = status.get("progress") or {}
    return status["state"] == "RUNNING" and progress.get("step", 0) >= 4 * SPEC["checkpoint_every"]


@pytest.fixture(scope="module")
def fault_jobs(job_server, tmp_path_factory):
    """Three jobs of one spec: ``reference`` submitted by `opentinker submit`, which is killed while it follows the
    job; ``process_killed`` whose flow-run process is killed (SIGKILL) mid-training; then ``server_killed``, running
    alone when the server and its worker are killed (SIGKILL) and the server is started again."""
    server = job_server
    key = server.make_key("faults")
    admin = server.headers(server.admin_key)
    assert HTTP.patch(f"{server.url}/v1/tenants/faults", headers=admin, json={"max_running_jobs": 3}).is_success
    home = tmp_path_factory.mktemp("laptop")
    env = {
        **os.environ,
        "OPENTINKER_SERVER_URL": server.url,
        "OPENTINKER_API_KEY": key,
        "OPENTINKER_DATA_DIR": str(home / "data"),
        "COLUMNS": "120",
    }
    (home / "spec.toml").write_text(
        "seed = 3\nnum_envs = 8\ncheckpoint_every = 1024\neval_episodes = 2\nchampion_threshold = 0.0\n"
        "[ppo]\nn_steps = 32\n"
    )
    client = subprocess.Popen(
        [str(Path(sys.executable).parent / "opentinker"), "submit", "CartPole-v1", "--steps", str(SPEC["steps"]),
         "--config", str(home / "spec.toml")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=home,
    )  # fmt: skip
    line = client.stdout.readline()
    assert "queued on" in line, line
    jobs = {"reference": line.split()[1]}
    wait_for_job(server, key, jobs["reference"], lambda s: s["state"] == "RUNNING")
    client.kill()  # the laptop goes away mid-job
    client.wait()

    # The flow-run process of one job (the attempt's trusted side, and with it its sandbox) dies (SIGKILL): Prefect
    # reports it crashed, the server queues the job again.
    # Submitted only now, so that nothing else is awaited while it trains: it cannot finish unobserved.
    jobs["process_killed"] = _submit(server, key)
    wait_for_job(server, key, jobs["process_killed"], _training)
    engine = [p for p, command in _job_processes(jobs["process_killed"]).items() if "server.attempt" in command]
    assert engine, "the attempt's process runs with its job id in its environment"
    for proc in engine:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()

    final = {name: wait_for_job(server, key, job_id, lambda s: s["state"] in FINAL) for name, job_id in jobs.items()}

    # The server dies (SIGKILL) mid-job with its worker, and the running jobs with the worker; then it comes back.
    # Prefect keeps the flow runs Running until their heartbeats are missed, then Crashed: the job is re-queued.
    jobs["server_killed"] = _submit(server, key)
    wait_for_job(server, key, jobs["server_killed"], _training)
    worker = json.loads((server.data_dir / "server" / "services.json").read_text())["worker"]["pid"]
    os.killpg(worker, signal.SIGKILL)
    server.kill()
    assert not _left_after(jobs["server_killed"], 10), "the job's processes end with the worker that ran them"
    server.restart()
    final["server_killed"] = wait_for_job(server, key, jobs["server_killed"], lambda s: s["state"] in FINAL)
    return server, key, final


def test_a_client_that_goes_away_does_not_stop_its_job(fault_jobs):
    _, _, final = fault_jobs
    assert final["reference"]["state"] == "SUCCEEDED", final["reference"]
    assert final["reference"]["attempts"] == 1


def test_a_killed_server_restarts_and_the_job_resumes_to_the_same_weights(fault_jobs):
    server, key, final = fault_jobs
    assert final["server_killed"]["state"] == "SUCCEEDED", final["server_killed"]
    assert final["server_killed"]["attempts"] == 2, final["server_killed"]  # its lost attempt was re-queued
    reference = _weights(server, key, final["reference"]["id"])
    after = _weights(server, key, final["server_killed"]["id"])
    assert reference.keys() == after.keys()
    assert all(np.array_equal(reference[name], after[name]) for name in reference)


def test_a_killed_job_process_resumes_from_its_checkpoint_with_the_same_weights(fault_jobs):
    server, key, final = fault_jobs
    job = final["process_killed"]
    assert job["state"] == "SUCCEEDED", job
    assert job["attempts"] == 2, job  # re-queued once after the crash, resumed from its last checkpoint
    assert _flow_run_states(server, job["id"]) == ["CRASHED", "COMPLETED"]  # each attempt its own flow run
    reference = _weights(server, key, final["reference"]["id"])
    resumed = _weights(server, key, job["id"])
    assert all(np.array_equal(reference[name], resumed[name]) for name in reference)


def _flow_run_states(server, job_id: str) -> list[str]:
    """The Prefect states of the job's flow runs, oldest first (read from the server's Prefect API)."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with SyncPrefectClient(f"{server.prefect_url}/api") as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"job:{job_id}"])))
    return [run.state.type.value for run in sorted(runs, key=lambda run: run.created)]


def test_cancel_stops_the_ray_work_within_seconds_and_keeps_the_checkpoint(job_server):
    server = job_server
    key = server.make_key("cancels")
    spec = {
        "env_id": "CartPole-v1",
        "steps": 5_000_000,
        "num_envs": 4,
        "workers": 2,
        "backend": "ray",
        "rollout_num_cpus": 0.5,
        "checkpoint_every": 1024,
        "ppo": {"n_steps": 64},
    }
    job_id = HTTP.post(f"{server.url}/v1/jobs", headers=server.headers(key), json={"spec": spec}).json()["id"]
    wait_for_job(server, key, job_id, lambda s: (s.get("progress") or {}).get("step", 0) >= 2048, timeout=400)
    processes = _job_processes(job_id)
    names = " ".join(processes.values())
    assert "raylet" in names and "gcs_server" in names, names[:2000]
    assert HTTP.post(f"{server.url}/v1/jobs/{job_id}/cancel", headers=server.headers(key)).status_code == 200
    started = time.monotonic()
    status = wait_for_job(server, key, job_id, lambda s: s["state"] == "CANCELLED" or s["state"] in FINAL, timeout=60)
    assert status["state"] == "CANCELLED", status
    assert not _left_after(job_id, 30 - (time.monotonic() - started)), "every process of the job, Ray's included"
    assert time.monotonic() - started < 30
    checkpoint = server.data_dir / "tenants" / "cancels" / "runs" / job_id / "checkpoints" / "checkpoint.pt"
    assert checkpoint.is_file()
