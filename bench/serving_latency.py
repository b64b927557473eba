"""Policy-service latency and throughput over loopback, against the in-process policy call.

Starts the service (``serving.deploy``) on a CartPole-shaped 4-64-64-2 PPO policy, then drives it from a
separate process (asyncio, raw HTTP/1.1 keep-alive, so the client costs little CPU) with a bounded load
(a request count and a time cap per phase):

- ``act`` one connection, sequential: latency p50/p99;
- ``act`` with ``--concurrency`` connections: requests/s (and latency under load);
- ``act_batch`` of ``--batch`` observations with ``--concurrency`` connections: requests/s and obs/s.

Reference, measured in the same command: the in-process ``InferencePolicy.act`` on one observation and a
plain numpy forward of the same MLP. Ends with one JSON line
``{"p50_ms", "p99_ms", "rps", "inprocess_us", ...}`` (p50/p99 of sequential ``act``, rps of concurrent ``act``).

    .venv/bin/python bench/serving_latency.py [--requests 3000] [--seconds 20] [--concurrency 16] [--lean]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

KEY = "bench-serving-key-0123456789"


def make_export(directory: Path) -> Path:
    """A real export of a 4-64-64-2 actor-critic for CartPole (the RL core's classes), seeded."""
    import gymnasium as gym
    import torch

    from opentinker.agents.export import export_policy
    from opentinker.agents.policies import ActorCritic, policy_spec

    env = gym.make("CartPole-v1")
    torch.manual_seed(0)
    policy = ActorCritic(policy_spec(env.observation_space, env.action_space, False, (64, 64), "tanh"))
    trainer_like = types.SimpleNamespace(
        policy=policy,
        algorithm="ppo",
        env_id="CartPole-v1",
        observation_space=env.observation_space,
        action_space=env.action_space,
    )
    return export_policy(trainer_like, directory)


def time_call(fn, repeats: int) -> float:
    """Median microseconds per call over ``repeats`` calls (after a warm-up)."""
    for _ in range(min(200, repeats)):
        fn()
    samples = np.empty(repeats)
    for i in range(repeats):
        start = time.perf_counter()
        fn()
        samples[i] = time.perf_counter() - start
    return float(np.median(samples) * 1e6)


def in_process_reference(export: Path) -> dict[str, float]:
    """In-process ``act`` on one observation vs a hand-written numpy forward of the same actor MLP."""
    from opentinker.agents.export import load_policy

    policy = load_policy(export)
    w = {k: v for k, v in np.load(export / "weights.npz").items()}
    obs = np.random.default_rng(0).uniform(-0.2, 0.2, size=(1, 4)).astype(np.float32)

    def plain_numpy():
        h = np.tanh(obs @ w["actor.0.weight"].T + w["actor.0.bias"])
        h = np.tanh(h @ w["actor.2.weight"].T + w["actor.2.bias"])
        return (h @ w["actor.4.weight"].T + w["actor.4.bias"]).argmax(axis=1)

    assert np.array_equal(plain_numpy(), policy.act(obs)), "the reference forward must compute the same action"
    inprocess = time_call(lambda: policy.act(obs), 5000)
    numpy_us = time_call(plain_numpy, 5000)
    return {"inprocess_us": inprocess, "numpy_mlp_us": numpy_us, "inprocess_vs_numpy": inprocess / numpy_us}


# ---------------------------------------------------------------------------------------------- driver process
def _request(host: str, port: int, path: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


async def _connection(host, port, request: bytes, budget: dict, latencies: list, statuses: dict):
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while budget["left"] > 0 and time.perf_counter() < budget["deadline"]:
            budget["left"] -= 1
            start = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = next(
                int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - start)
            statuses[status] = statuses.get(status, 0) + 1
    finally:
        writer.close()


async def _phase(host, port, path, body, requests, seconds, concurrency) -> dict:
    request = _request(host, port, path, body)
    budget = {"left": requests, "deadline": time.perf_counter() + seconds}
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    start = time.perf_counter()
    await asyncio.gather(*(_connection(host, port, request, budget, latencies, statuses) for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    lat = np.asarray(latencies) * 1e3
    return {
        "requests": len(lat),
        "seconds": elapsed,
        "rps": len(lat) / elapsed,
        "statuses": statuses,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
    }


PHASES = {  # name -> (path, observations per request or None for one, share of --requests, connections)
    "act_sequential": ("/act", None, 1.0, 1),
    "act_concurrent": ("/act", None, 1.0, "concurrency"),
    "act_batch_concurrent": ("/act_batch", "batch", 0.25, "concurrency"),
}


def drive(config: dict) -> dict:
    """Runs in its own process: one phase, bounded by request count and time, after a short warm-up."""
    path, rows, share, connections = PHASES[config["phase"]]
    rng = np.random.default_rng(1)
    obs = rng.uniform(-0.2, 0.2, 4) if rows is None else rng.uniform(-0.2, 0.2, (config[rows], 4))
    body = {"obs": obs.round(4).tolist()}
    concurrency = config[connections] if isinstance(connections, str) else connections

    async def run():
        await _phase(config["host"], config["port"], path, body, 100, 5, 1)
        return await _phase(
            config["host"],
            config["port"],
            path,
            body,
            max(int(config["requests"] * share), 1),
            config["seconds"],
            concurrency,
        )

    return asyncio.run(run())


def server_cpu_seconds(pid: int) -> float:
    """User+system CPU of the server and all its processes so far."""
    import psutil

    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(sum(p.cpu_times()[:2]) for p in procs)


# ---------------------------------------------------------------------------------------------- orchestration
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000, help="requests per phase (act_batch: a quarter)")
    parser.add_argument("--seconds", type=float, default=20.0, help="time cap per phase")
    parser.add_argument("--concurrency", type=int, default=16, help="connections in the concurrent phases")
    parser.add_argument("--batch", type=int, default=64, help="observations per act_batch request")
    parser.add_argument("--workers", type=int, default=1, help="server worker processes")
    parser.add_argument("--lean", action="store_true", help="serve without access log and Prometheus metrics")
    parser.add_argument("--drive", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:
        print(json.dumps(drive(json.loads(args.drive))))
        return

    from rich.console import Console

    from opentinker.serving.deploy import deploy

    console = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="opentinker-bench-serving-") as tmp:
        export = make_export(Path(tmp) / "export")
        reference = in_process_reference(export)
        console.print(
            f"in-process act {reference['inprocess_us']:.1f} µs, plain numpy MLP {reference['numpy_mlp_us']:.1f} µs"
        )
        settings = {
            "workers": args.workers,
            "max_concurrency": max(64, 4 * args.concurrency),
            "reload_interval_s": 0,
            "access_log": not args.lean,
            "metrics": not args.lean,
        }
        with console.status("starting bentoml serve…"):
            service = deploy(export, KEY, settings=settings, log_path=Path(tmp) / "server.log")
        try:
            host, port = service.url.removeprefix("http://").split(":")
            phases = {}
            for phase in PHASES:
                config = {
                    "phase": phase,
                    "host": host,
                    "port": int(port),
                    "requests": args.requests,
                    "seconds": args.seconds,
                    "concurrency": args.concurrency,
                    "batch": args.batch,
                }
                cpu_before = server_cpu_seconds(service.process.pid)
                with console.status(f"{phase}: driving the service from a separate process…"):
                    done = subprocess.run(
                        [sys.executable, __file__, "--drive", json.dumps(config)],
                        capture_output=True,
                        text=True,
                        timeout=args.seconds * 3 + 120,
                    )
                if done.returncode != 0:
                    raise SystemExit(f"driver failed: {done.stderr[-2000:]}")
                phases[phase] = json.loads(done.stdout.strip().splitlines()[-1])
                cpu = server_cpu_seconds(service.process.pid) - cpu_before
                phases[phase]["server_cpu_ms_per_req"] = cpu * 1e3 / (phases[phase]["requests"] + 100)
        finally:
            service.stop()
    for name, phase in phases.items():
        console.print(
            f"{name:22s} {phase['requests']:6d} req in {phase['seconds']:5.1f} s  {phase['rps']:8.0f} req/s  "
            f"p50 {phase['p50_ms']:6.2f} ms  p99 {phase['p99_ms']:6.2f} ms  "
            f"server CPU {phase['server_cpu_ms_per_req']:.2f} ms/req  statuses {phase['statuses']}"
        )
    seq, conc, batch = phases["act_sequential"], phases["act_concurrent"], phases["act_batch_concurrent"]
    result = {
        "p50_ms": round(seq["p50_ms"], 3),
        "p99_ms": round(seq["p99_ms"], 3),
        "rps": round(conc["rps"], 1),
        "inprocess_us": round(reference["inprocess_us"], 2),
        "numpy_mlp_us": round(reference["numpy_mlp_us"], 2),
        "inprocess_vs_numpy": round(reference["inprocess_vs_numpy"], 2),
        "http_p50_vs_inprocess": round(seq["p50_ms"] * 1e3 / reference["inprocess_us"], 1),
        "concurrent_p50_ms": round(conc["p50_ms"], 3),
        "concurrent_p99_ms": round(conc["p99_ms"], 3),
        "batch_rps": round(batch["rps"], 1),
        "batch_obs_per_s": round(batch["rps"] * args.batch, 1),
        "batch_p50_ms": round(batch["p50_ms"], 3),
        "batch_p99_ms": round(batch["p99_ms"], 3),
        "server_cpu_ms_per_act": round(seq["server_cpu_ms_per_req"], 3),
        "server_cpu_ms_per_batch": round(batch["server_cpu_ms_per_req"], 3),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "non_200": sum(v for p in phases.values() for k, v in p["statuses"].items() if str(k) != "200"),
        "concurrency": args.concurrency,
        "batch": args.batch,
        "workers": args.workers,
        "lean": args.lean,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
