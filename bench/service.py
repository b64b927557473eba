"""The OpenTinker server against local training and under load, one command:

    .venv/bin/python bench/service.py

Starts its own `opentinker server up` (fresh data dir: SQLite, its own Prefect server — on SQLite, or with
``--prefect-database postgres`` on an embedded PostgreSQL —, one sandboxed worker) and measures four things; the last
line is JSON.

(a) ``ratio = api_s / local_s``: the same CartPole job (``--steps``, the CLI's preset) through the API (submit →
    SUCCEEDED, the model registered) and through ``opentinker train`` run the way a user runs it on the same
    machine, pointed at the same Prefect server (so neither pays Prefect's start-up), each with a fresh MLflow store.
    Target ≤ 1.10.
(b) ``submit_to_running_s``: submit → RUNNING (a worker has taken the job and started its sandbox) with an idle
    worker, ``--latency-jobs`` times after one warm-up submit (the env check of a new env id runs once). Target ≤ 2 s.
(c) ``--clients`` concurrent clients for ``--duration`` s, each following the job's server-sent events and polling
    its status, while one job trains: status p50/p99 (target p99 ≤ 50 ms), errors (target 0), and the job's steps/s
    under the load against the same job alone just before and just after it (``sps_ratio``, target ≥ 0.90).
(d) ``--jobs`` small jobs (``--small-steps`` each) from ``--tenants`` tenants (``max_running_jobs`` = ``--limit``,
    priorities 0-3), all submitted at once: every tenant's RUNNING count sampled every 0.25 s never passes its limit,
    a higher-priority job of a tenant never starts after a lower one that was queued beside it, every job ends in a
    final state, none lost.

(e) The sandbox's own cost per attempt, without the server: ``sandbox_start_s``, from starting an attempt's child
    (bubblewrap, its cgroup, a fresh scratch folder, the channel) to its first message, against the same child as a
    plain process (``plain_start_s``; ``sandbox_start_overhead_s`` the difference); ``channel_round_trip_us``, one
    message each way over the attempt's channel (median of ``--round-trips``).

``--topology production`` runs (a)-(d) against the production topology on loopback instead (PostgreSQL, Prefect,
MLflow with per-tenant users over S3, two API processes behind HAProxy, a worker of its own: docs/deploy.md);
``--topology both`` runs the embedded server and then that topology in one command and adds their ratios on (a)
(``production_vs_embedded_a``: the API job's time) and (b) (the median submit to RUNNING). Targets there: both ratios
≤ 1.2, (c) status p99 ≤ 50 ms through the load balancer, (d) nothing lost.

Smoke test at tiny sizes: ``--steps 20000 --latency-jobs 2 --clients 4 --duration 5 --jobs 8 --small-steps 512``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from rich.progress import Progress

FINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
POLL_S = 0.5
"""(c): each client asks for the job's status every half second (while its event stream stays open)."""
QUIET_S = 10.0
"""(b): pause between timed submits, so the previous job's processes are gone and the worker is idle."""
PROBE_S = 0.1
"""(c): the probe's pause between its status requests."""
CLIENTS_PER_PROCESS = 10
"""(c): clients sharing one load-generating process."""
INVERSION_MARGIN_S = 1.0
"""(d): times closer than this are one worker poll: a job the worker took just before a higher-priority one was
submitted shows as started just after it (its Pending is proposed after the take; the server learns of starts four
times a second)."""


class Bench:
    """One server for the whole bench, its admin side (keys, quotas) and small HTTP helpers."""

    def __init__(self, root: Path, prefect_database: str):
        from opentinker.server.launcher import start_server

        self.root = root
        self.env = {
            **os.environ,
            "OPENTINKER_DATA_DIR": str(root / "data"),
            "OPENTINKER_SERVER_PREFECT_DATABASE": prefect_database,
            "PYTHONWARNINGS": "ignore",
        }
        self.service = start_server(root / "server.log", jobs=True, env=self.env, timeout=600)
        self.url = self.service.url
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def key(self, tenant: str, **quotas) -> str:
        from opentinker.server.db import Store
        from opentinker.server.keys import KeyRing
        from opentinker.server.tenants import set_quotas

        store = Store(f"sqlite:///{self.root / 'data' / 'server' / 'server.db'}")
        try:
            _, key = KeyRing(store).create(tenant)
            with store.session() as session:
                set_quotas(session, tenant, **quotas)
            return key
        finally:
            store.close()

    def submit(self, key: str, spec: dict, priority: int = 0) -> dict:
        answer = self.http.post("/v1/jobs", headers=_auth(key), json={"spec": spec, "priority": priority})
        answer.raise_for_status()
        return answer.json()

    def status(self, key: str, job_id: str) -> dict:
        return self.http.get(f"/v1/jobs/{job_id}", headers=_auth(key)).json()

    def wait(self, key: str, job_id: str, until, poll_s: float = 0.05, timeout: float = 3600) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.status(key, job_id)
            if until(status):
                return status
            time.sleep(poll_s)
        raise TimeoutError(f"{job_id}: {status}")

    def prefect_api(self) -> str:
        services = json.loads((self.root / "data" / "server" / "services.json").read_text())
        return f"{services['prefect']['url']}/api"

    def stop(self) -> None:
        from opentinker.infra.settings import Settings
        from opentinker.server.launcher import stop_services

        self.service.stop()
        stop_services(Settings(data_dir=self.root / "data"))


class ProductionBench(Bench):
    """The same bench against the production topology on loopback (``opentinker.server.topology``): PostgreSQL,
    Prefect, MLflow with per-tenant users over S3, two API processes behind HAProxy, a worker of its own."""

    def __init__(self, root: Path):
        from opentinker.server.topology import Topology

        self.root = root
        self.env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        self.topology = Topology.up(root / "production", pool_limit=os.cpu_count() or 1)
        self.url = self.topology.url
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def key(self, tenant: str, **quotas) -> str:
        return self.topology.make_key(tenant, **quotas)

    def prefect_api(self) -> str:
        return self.topology.prefect_url

    def stop(self) -> None:
        self.topology.down()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def api_vs_local(bench: Bench, steps: int) -> dict:
    """(a): the same job through the API and through `opentinker train` (same Prefect server, fresh stores)."""
    key = bench.key("bench-a", max_steps_per_job=None)
    started = time.perf_counter()
    job = bench.submit(key, {"env_id": "CartPole-v1", "steps": steps, "seed": 1})
    final = bench.wait(key, job["id"], lambda s: s["state"] in FINAL, poll_s=0.1)
    api_s = time.perf_counter() - started
    assert final["state"] == "SUCCEEDED", final
    data = bench.root / "local"
    data.mkdir()
    env = {**bench.env, "OPENTINKER_DATA_DIR": str(data), "OPENTINKER_PREFECT_API_URL": bench.prefect_api()}
    started = time.perf_counter()
    subprocess.run(
        [str(Path(sys.executable).parent / "opentinker"), "train", "CartPole-v1", "--steps", str(steps), "--seed", "1"],
        env=env, cwd=data, check=True, capture_output=True,
    )  # fmt: skip
    local_s = time.perf_counter() - started
    return {"api_s": round(api_s, 2), "local_s": round(local_s, 2), "ratio": round(api_s / local_s, 3)}


def submit_to_running(bench: Bench, jobs: int) -> dict:
    """(b): submit → RUNNING with an idle worker (each job cancelled once it runs)."""
    key = bench.key("bench-b")
    spec = {"env_id": "CartPole-v1", "steps": 1_000_000}
    warm = bench.submit(key, spec)  # the env check of a new env id runs once, then it is remembered
    bench.wait(key, warm["id"], lambda s: s["state"] == "RUNNING")
    bench.http.post(f"/v1/jobs/{warm['id']}/cancel", headers=_auth(key))
    bench.wait(key, warm["id"], lambda s: s["state"] in FINAL)
    seconds, submits, takes = [], [], []
    for _ in range(jobs):
        time.sleep(QUIET_S)  # the previous job's processes are gone, the worker idle between two of its polls
        started = time.perf_counter()
        job = bench.submit(key, spec)
        submits.append(time.perf_counter() - started)
        running = bench.wait(key, job["id"], lambda s: s["state"] == "RUNNING", poll_s=0.02)
        seconds.append(time.perf_counter() - started)
        takes.append(_pending_after_created(bench, running["flow_run_id"]))
        bench.http.post(f"/v1/jobs/{job['id']}/cancel", headers=_auth(key))
        bench.wait(key, job["id"], lambda s: s["state"] in FINAL)
    return {
        "submit_to_running_s": [round(s, 3) for s in seconds],
        "submit_to_running_median_s": round(statistics.median(seconds), 3),
        "submit_to_running_max_s": round(max(seconds), 3),
        "submit_answer_s": [round(s, 3) for s in submits],
        "worker_take_s": [round(s, 3) for s in takes],
    }


def _pending_after_created(bench: Bench, flow_run_id: str) -> float:
    """How long the flow run waited for a worker: its Pending state's time minus its creation (Prefect's clock)."""
    api = bench.prefect_api()
    created = httpx.get(f"{api}/flow_runs/{flow_run_id}").json()["created"]
    states = httpx.get(f"{api}/flow_run_states/", params={"flow_run_id": flow_run_id}).json()
    pending = min(_seconds(state["timestamp"]) for state in states if state["type"] == "PENDING")
    return pending - _seconds(created)


def _sps(bench: Bench, key: str, job_id: str, samples: list[tuple[float, float]], stop: threading.Event) -> None:
    """The job's steps/s as its progress reports it, with the time it was read, twice a second."""
    while not stop.is_set():
        progress = bench.status(key, job_id).get("progress") or {}
        if progress.get("phase") == "training" and progress.get("steps_per_s"):
            samples.append((time.monotonic(), progress["steps_per_s"]))
        stop.wait(0.5)


def under_load(bench: Bench, clients: int, duration: float, steps: int) -> dict:
    """(c): one job trains through three windows, alone for ``duration / 2`` s, then ``clients`` clients follow its
    events and poll its status for ``duration`` s, then alone again; ``sps_ratio`` is its median steps/s under load
    over the median of both alone windows. One job sampled around the load, not two jobs one after the other: this
    machine's pace drifts by up to ±10 % over minutes (a fixed numpy loop, nothing else running), and the load
    generators start (and import) before the first window, so neither counts as load."""
    key = bench.key("bench-c", max_steps_per_job=None)
    job = bench.submit(key, {"env_id": "CartPole-v1", "steps": steps, "seed": 2})
    bench.wait(key, job["id"], lambda s: (s.get("progress") or {}).get("phase") == "training", poll_s=0.1)
    samples: list[tuple[float, float]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sps, args=(bench, key, job["id"], samples, stop))
    groups = [min(CLIENTS_PER_PROCESS, clients - start) for start in range(0, clients, CLIENTS_PER_PROCESS)]
    with multiprocessing.get_context("spawn").Pool(len(groups), initializer=_import_clients) as pool:
        pool.map(_ready, range(len(groups)))  # every process started and its client libraries imported
        sampler.start()
        alone = [_quiet_window(duration / 2)]
        loaded_from = time.monotonic()
        figures = _client_processes(pool, groups, bench.url, key, job["id"], duration)
        loaded = (loaded_from, time.monotonic())
        alone.append(_quiet_window(duration / 2))
    stop.set()
    sampler.join()
    bench.http.post(f"/v1/jobs/{job['id']}/cancel", headers=_auth(key))
    bench.wait(key, job["id"], lambda s: s["state"] in FINAL)

    def median_in(windows: list[tuple[float, float]]) -> float:
        inside = [sps for at, sps in samples if any(start <= at <= end for start, end in windows)]
        return statistics.median(inside) if inside else float("nan")

    sps_alone, sps_loaded = median_in(alone), median_in([loaded])
    latencies, probe = sorted(figures["latencies"]), sorted(figures["probe_latencies"])
    return {
        "clients": clients,
        "status_requests": len(latencies),
        "status_p50_ms": round(1000 * latencies[len(latencies) // 2], 2) if latencies else None,
        "status_p99_ms": round(1000 * latencies[int(len(latencies) * 0.99)], 2) if latencies else None,
        "probe_requests": len(probe),
        "probe_p50_ms": round(1000 * probe[len(probe) // 2], 2) if probe else None,
        "probe_p99_ms": round(1000 * probe[int(len(probe) * 0.99)], 2) if probe else None,
        "events_received": figures["events"],
        "errors": figures["errors"],
        "sps_alone": round(sps_alone, 1),
        "sps_loaded": round(sps_loaded, 1),
        "sps_ratio": round(sps_loaded / sps_alone, 3),
    }


def _quiet_window(seconds: float) -> tuple[float, float]:
    started = time.monotonic()
    time.sleep(seconds)
    return started, time.monotonic()


def _import_clients() -> None:
    import aiohttp  # noqa: F401
    import uvloop  # noqa: F401


def _ready(_: int) -> bool:
    return True


def _client_processes(pool, groups: list[int], url: str, key: str, job_id: str, duration: float) -> dict:
    """The clients in ``CLIENTS_PER_PROCESS`` groups, each group one process of ``pool`` with its own event loop: a
    single loop serving fifty streams and pollers delays its own responses (p99 ~300 ms measured by the clients
    while a separate probe saw 19 ms), which would time the load generator, not the server."""
    probe_latencies, stop = [], threading.Event()
    probe = threading.Thread(target=_probe, args=(url, key, job_id, probe_latencies, stop))
    probe.start()
    results = pool.starmap(_clients_in_process, [(url, key, job_id, n, duration) for n in groups])
    stop.set()
    probe.join()
    return {
        "probe_latencies": probe_latencies,
        "latencies": [seconds for result in results for seconds in result["latencies"]],
        "events": sum(result["events"] for result in results),
        "errors": sum(result["errors"] for result in results),
    }


def _probe(url: str, key: str, job_id: str, latencies: list[float], stop: threading.Event) -> None:
    """One more client beside the load, one status request at a time (10 a second): what a user sees of the server
    while the others load it, without the load generators' own queueing."""
    with httpx.Client(base_url=url, headers=_auth(key), timeout=30) as http:
        while not stop.wait(PROBE_S):
            started = time.perf_counter()
            http.get(f"/v1/jobs/{job_id}").raise_for_status()
            latencies.append(time.perf_counter() - started)


def _clients_in_process(url: str, key: str, job_id: str, clients: int, duration: float) -> dict:
    import uvloop  # the event loop uvicorn serves on: less of each core spent in the load generator's own loop

    return uvloop.run(_clients(url, key, job_id, clients, duration))


async def _clients(url: str, key: str, job_id: str, clients: int, duration: float) -> dict:
    """``clients`` clients, each following the job's event stream and polling its status, for ``duration`` s.

    aiohttp, not httpx: the load generators share the machine's cores with the server and the job, and aiohttp's
    client spends a fraction of httpx's CPU per request, so less of the load measures the load generator."""
    import aiohttp

    latencies: list[float] = []
    counts = {"events": 0, "errors": 0}
    deadline = time.monotonic() + duration
    connector = aiohttp.TCPConnector(limit=2 * clients)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=30)
    async with aiohttp.ClientSession(url, headers=_auth(key), connector=connector, timeout=timeout) as http:

        async def follow() -> None:
            try:
                async with http.get(f"/v1/jobs/{job_id}/events") as stream:
                    stream.raise_for_status()
                    async for line in stream.content:
                        counts["events"] += line.startswith(b"event:")
                        if time.monotonic() > deadline:
                            return
            except aiohttp.ClientError:
                counts["errors"] += 1

        async def poll() -> None:
            await asyncio.sleep(random.uniform(0, POLL_S))  # independent clients: not all in the same instant
            while time.monotonic() < deadline:
                started = time.perf_counter()
                try:
                    async with http.get(f"/v1/jobs/{job_id}") as answer:
                        await answer.read()
                        counts["errors"] += answer.status != 200
                except aiohttp.ClientError:
                    counts["errors"] += 1
                latencies.append(time.perf_counter() - started)
                await asyncio.sleep(POLL_S)

        await asyncio.gather(*(follow() for _ in range(clients)), *(poll() for _ in range(clients)))
    return {"latencies": latencies, **counts}


def many_jobs(bench: Bench, jobs: int, tenants: int, limit: int, steps: int) -> dict:
    """(d): ``jobs`` small jobs from ``tenants`` tenants at once, under their running-jobs limits."""
    keys = {
        f"bench-d{i}": bench.key(f"bench-d{i}", max_running_jobs=limit, max_queued_jobs=jobs) for i in range(tenants)
    }
    spec = {"env_id": "CartPole-v1", "steps": steps, "eval_episodes": 2, "champion_threshold": 0.0}
    submitted, submit_s, began = [], [], time.perf_counter()
    for n in range(jobs):
        tenant = f"bench-d{n % tenants}"
        priority = (n // tenants) % 4
        started = time.perf_counter()
        job = bench.submit(keys[tenant], spec, priority=priority)
        submit_s.append(time.perf_counter() - started)
        submitted.append({"tenant": tenant, "id": job["id"], "priority": priority, "submitted": time.time()})
    over_limit, samples, started_at = 0, 0, {}
    while True:
        states = {}
        for key in keys.values():
            listed = bench.http.get("/v1/jobs", headers=_auth(key), params={"limit": 1000}).json()
            running = sum(job["state"] == "RUNNING" for job in listed)
            over_limit += running > limit
            for job in listed:
                states[job["id"]] = job["state"]
                if job["started_at"] and job["id"] not in started_at:
                    started_at[job["id"]] = job["started_at"]
        samples += 1
        if all(states.get(job["id"]) in FINAL for job in submitted):
            break
        time.sleep(0.25)
    inversions = 0
    for a in submitted:
        for b in submitted:
            same = a["tenant"] == b["tenant"] and a["priority"] > b["priority"]
            if not (same and a["id"] in started_at and b["id"] in started_at):
                continue
            b_first = _seconds(started_at[b["id"]]) < _seconds(started_at[a["id"]]) - INVERSION_MARGIN_S
            a_waited = _seconds(started_at[b["id"]]) > a["submitted"] + INVERSION_MARGIN_S  # a was queued then
            inversions += b_first and a_waited
    final = [states.get(job["id"]) for job in submitted]
    return {
        "jobs": jobs,
        "wall_s": round(time.perf_counter() - began, 1),
        "submit_p50_s": round(statistics.median(submit_s), 3),
        "submit_max_s": round(max(submit_s), 3),
        "submit_slowest": sorted(((round(s, 2), i) for i, s in enumerate(submit_s)), reverse=True)[:5],
        "succeeded": final.count("SUCCEEDED"),
        "final": sum(state in FINAL for state in final),
        "lost": jobs - sum(state in FINAL for state in final),
        "limit_samples": samples,
        "limit_violations": over_limit,
        "priority_inversions": inversions,
    }


ECHO = """
import os
from opentinker.server.channel import Channel, Metrics
channel = Channel.from_fd(int(os.environ["OPENTINKER_CHANNEL_FD"]))
while True:
    try:
        channel.receive_start()
    except EOFError:
        break
    channel.send(Metrics(step=0, values={}))
"""


def sandbox_overhead(attempts: int, round_trips: int) -> dict:
    """(e): an attempt's child started as the worker starts it (sandboxed, in its cgroup) and as a plain process,
    interleaved; then messages over its channel."""
    import logging

    from opentinker.infra.cgroups import limits_for
    from opentinker.infra.settings import get_settings
    from opentinker.server.channel import Start
    from opentinker.server.sandboxed import SandboxedChild
    from opentinker.server.schemas import LaunchInfo

    launch = LaunchInfo(
        job_id="bench",
        tenant="bench",
        token="-",
        spec={},
        job_dir=tempfile.mkdtemp(prefix="opentinker-bench-job-"),
        tracking_uri="",
        experiment="",
        readonly=[],
        env={},
        limits=dataclasses.asdict(limits_for(None)),
        isolated=True,
    )
    log = logging.getLogger("bench")

    def start(mode: str) -> tuple[float, SandboxedChild]:
        os.environ["OPENTINKER_SANDBOX"] = mode
        os.environ["OPENTINKER_JOB_LIMITS"] = "cgroup" if mode == "bwrap" else "none"
        get_settings.cache_clear()
        started = time.perf_counter()
        child = SandboxedChild(launch, Path(launch.job_dir), None, log, command=("-c", ECHO))
        child.channel.send(Start(spec={}))
        next(child.channel.messages(1, 1))
        return time.perf_counter() - started, child

    times: dict[str, list[float]] = {"bwrap": [], "none": []}
    with Progress() as progress:
        task = progress.add_task("(e) attempt start-up, sandboxed and plain", total=attempts)
        for _ in range(attempts):
            for name in ("bwrap", "none"):
                seconds, child = start(name)
                times[name].append(seconds)
                child.channel.close()
                child.close()
            progress.advance(task)
    _, child = start("bwrap")
    messages = child.channel.messages(1, 1)
    trips = []
    for _ in range(round_trips):
        started = time.perf_counter()
        child.channel.send(Start(spec={}))
        next(messages)
        trips.append(time.perf_counter() - started)
    child.channel.close()
    child.close()
    shutil.rmtree(launch.job_dir, ignore_errors=True)
    sandboxed, plain = statistics.median(times["bwrap"]), statistics.median(times["none"])
    return {
        "sandbox_start_s": round(sandboxed, 3),
        "plain_start_s": round(plain, 3),
        "sandbox_start_overhead_s": round(sandboxed - plain, 3),
        "channel_round_trip_us": round(statistics.median(trips) * 1e6, 1),
    }


def _seconds(iso: str) -> float:
    import datetime

    return datetime.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000, help="(a) env steps of the CartPole job")
    parser.add_argument("--latency-jobs", type=int, default=10, help="(b) submits timed to RUNNING")
    parser.add_argument("--clients", type=int, default=50, help="(c) concurrent clients")
    parser.add_argument("--duration", type=float, default=60.0, help="(c) seconds of load")
    parser.add_argument("--jobs", type=int, default=200, help="(d) small jobs")
    parser.add_argument("--tenants", type=int, default=4, help="(d) tenants")
    parser.add_argument("--limit", type=int, default=2, help="(d) max_running_jobs of each tenant")
    parser.add_argument("--small-steps", type=int, default=4096, help="(d) env steps of each small job")
    parser.add_argument("--attempts", type=int, default=10, help="(e) attempt start-ups timed per mode")
    parser.add_argument("--round-trips", type=int, default=1000, help="(e) messages each way over the channel")
    parser.add_argument("--parts", default="abcde", help="which of (a)-(e) to run, e.g. 'cd'")
    parser.add_argument("--keep", action="store_true", help="keep the server's data dir (its logs) and print it")
    parser.add_argument(
        "--prefect-database", choices=("sqlite", "postgres"), default="sqlite", help="the embedded Prefect's database"
    )
    parser.add_argument(
        "--topology",
        choices=("embedded", "production", "both"),
        default="embedded",
        help="the server `opentinker server up` embeds, the production topology on loopback "
        "(docs/deploy.md), or both in one command (their ratios on (a) and (b))",
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stopped: still stop the server it started
    figures: dict = {"load_avg_1m_start": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()}
    topologies = ("embedded", "production") if args.topology == "both" else (args.topology,)
    for topology in topologies:
        measured = _run(args, topology, args.parts if topology == "embedded" else args.parts.replace("e", ""))
        if len(topologies) == 1:
            figures.update(measured)
        else:
            figures[topology] = measured
            print(json.dumps(figures), flush=True)
    if len(topologies) == 2:
        embedded, production = figures["embedded"], figures["production"]
        for name, key in (("a", "api_s"), ("b", "submit_to_running_median_s")):
            if key in embedded and key in production:
                figures[f"production_vs_embedded_{name}"] = round(production[key] / embedded[key], 3)
        if "ratio" in embedded and "ratio" in production:  # the machine's load drifts between the two halves: (a)
            # against the same local run in each half as well
            figures["production_vs_embedded_a_per_local"] = round(production["ratio"] / embedded["ratio"], 3)
    figures["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(figures))


def _run(args, topology: str, wanted: str) -> dict:
    """The parts ``wanted`` against one server (``topology``); its figures."""
    root = Path(tempfile.mkdtemp(prefix=f"opentinker-bench-service-{topology}-"))
    bench = Bench(root, args.prefect_database) if topology == "embedded" else ProductionBench(root)
    figures: dict = {"topology": topology}
    if topology == "embedded":
        figures["prefect_database"] = args.prefect_database
    parts = {
        "b": lambda: submit_to_running(bench, args.latency_jobs),
        "a": lambda: api_vs_local(bench, args.steps),
        "c": lambda: under_load(bench, args.clients, args.duration, max(args.steps, 50_000_000)),
        "d": lambda: many_jobs(bench, args.jobs, args.tenants, args.limit, args.small_steps),
        "e": lambda: sandbox_overhead(args.attempts, args.round_trips),
    }
    try:
        for name, part in parts.items():
            if name in wanted:
                figures.update(part())
                print(json.dumps(figures), flush=True)
    finally:
        bench.stop()
        if args.keep:
            print(f"kept: {bench.root}", file=sys.stderr)
        else:
            from opentinker.infra.postgres import cluster_dir

            for postgres in (root / "data" / "server" / "postgres", root / "production" / "postgres"):
                shutil.rmtree(cluster_dir(postgres), ignore_errors=True)
            shutil.rmtree(root, ignore_errors=True)
    return figures


if __name__ == "__main__":
    main()
