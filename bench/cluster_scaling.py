"""Rollout throughput of RemoteEnv on a 1-node and a 2-node loopback Ray cluster (issue 9).

Both clusters are real (`opentinker cluster up` machinery: separate raylets, one CPU each) and measured in the
same command. The env is CartPole with an artificial CPU cost per step, so stepping, not IPC, dominates.
Weak scaling: each node runs one rollout worker with the same number of env copies, collecting
``--n-steps`` steps per call with a numpy copy of a CartPole MLP policy (``RemoteEnv.collect``, the training path).
Final line: {"sps_1node": ..., "sps_2node": ..., "efficiency": sps_2node / (2 * sps_1node), ...}

    .venv/bin/python bench/cluster_scaling.py [--step-cost-ms 0.5] [--envs-per-node 8] [--seconds 20]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from costly_env import CostlyCartPole  # bench/ is sys.path[0]; Ray workers get the driver's path too
from rich.progress import Progress


def measure(nodes: int, args: argparse.Namespace, progress: Progress) -> float:
    """Start a ``nodes``-node cluster, step RemoteEnv on it for ``args.seconds``, stop it; env steps per second."""
    import ray

    from opentinker.agents.policies import ActorCritic, policy_spec
    from opentinker.envs import RemoteEnv
    from opentinker.infra.cluster import LocalCluster
    from opentinker.infra.settings import Settings, get_settings

    root = Path(tempfile.mkdtemp(prefix=f"cluster-bench-{nodes}-"))
    cluster = LocalCluster(root=root / "cluster", settings=Settings(data_dir=root))
    task = progress.add_task(f"{nodes} node(s): starting cluster", total=args.seconds)
    try:
        os.environ["OPENTINKER_RAY_ADDRESS"] = cluster.up(nodes=nodes, cpus_per_node=1, object_store_mb=256)
        get_settings.cache_clear()
        envs = RemoteEnv(
            CostlyCartPole,
            parallel=args.envs_per_node * nodes,
            workers=nodes,
            backend="ray",
            validate=False,
            cost_ms=args.step_cost_ms,
        )
        try:
            spec = policy_spec(
                envs.single_observation_space,
                envs.single_action_space,
                value_based=False,
                hidden=(64, 64),
                activation="tanh",
            )
            weights = ActorCritic(spec).numpy_weights()
            envs.collect(weights, spec, n_steps=args.n_steps, iteration=0)  # warm-up: actors started, policy shipped
            progress.update(task, description=f"{nodes} node(s): collecting")
            steps, iteration, start = 0, 1, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < args.seconds:
                envs.collect(weights, spec, n_steps=args.n_steps, iteration=iteration)
                steps += args.n_steps * envs.num_envs
                iteration += 1
                progress.update(task, completed=min(elapsed, args.seconds))
            return steps / (time.perf_counter() - start)
        finally:
            envs.close()
    finally:
        ray.shutdown()
        os.environ.pop("OPENTINKER_RAY_ADDRESS", None)
        get_settings.cache_clear()
        cluster.down()
        progress.update(task, completed=args.seconds, description=f"{nodes} node(s): done")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-cost-ms", type=float, default=0.5, help="CPU burned per env step (ms).")
    parser.add_argument(
        "--envs-per-node", type=int, default=8, help="Env copies per node (one rollout worker per node)."
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="Measured stepping time per cluster size.")
    parser.add_argument("--n-steps", type=int, default=64, help="Steps per env copy in each collect call.")
    args = parser.parse_args()
    with Progress() as progress:
        sps_1 = measure(1, args, progress)
        sps_2 = measure(2, args, progress)
    print(
        json.dumps(
            {
                "sps_1node": round(sps_1, 1),
                "sps_2node": round(sps_2, 1),
                "efficiency": round(sps_2 / (2 * sps_1), 3),
                "step_cost_ms": args.step_cost_ms,
                "envs_per_node": args.envs_per_node,
                "n_steps": args.n_steps,
                "cpus_per_node": 1,
                "machine_cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
