"""Learner scaling (issue 19): update throughput and all-reduce cost for 1 and 2 data-parallel learners.

PPO updates on one fixed CartPole rollout of 8,192 transitions (64 envs x 128 steps) with a 2x256 MLP, 2 epochs x
4 minibatches of 2,048 rows. The reference, 1 learner in this process (what ``num_learners=1`` runs), is measured in
the same command as a ``LearnerGroup`` of 2 (Ray actors, gloo all-reduce over loopback), one torch thread each,
the two timed alternately (medians).
Final line: {"sps_1": ..., "sps_2": ..., "efficiency": sps_2 / (2 * sps_1), "allreduce_ms_per_update": ..., ...}
where samples/s counts rows through the learner (batch x epochs per update / wall time of the update).

    .venv/bin/python bench/learner_scaling.py [--updates 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from rich.progress import Progress

CONFIG = dict(
    num_envs=64,
    n_steps=128,
    hidden_sizes=(256, 256),
    num_minibatches=4,
    update_epochs=2,
    backend="local",
    total_steps=10_000_000,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=5, help="timed updates per learner count (medians)")
    args = parser.parse_args()

    import ray
    import torch

    from opentinker.agents import PPO
    from opentinker.agents.learners import LearnerGroup
    from opentinker.infra.ray_runtime import ensure_ray

    ensure_ray()
    torch.set_num_threads(1)  # what train() sets (torch_threads=1) and what each learner actor runs with
    single = PPO("CartPole-v1", seed=0, **CONFIG)
    rollout = single.collect()
    samples = rollout.num_steps * CONFIG["update_epochs"]
    group = LearnerGroup(PPO("CartPole-v1", seed=0, num_learners=2, **CONFIG), 2)
    seconds: dict[int, list[float]] = {1: [], 2: []}
    allreduce_ms: list[float] = []
    try:
        single.update(rollout)  # warm-up; gloo connects its pairs on the group's first collective
        group.update(rollout)
        with Progress() as progress:
            task = progress.add_task("1 and 2 learners, interleaved", total=args.updates)
            for _ in range(args.updates):  # interleaved, so a change in the machine's load hits both alike
                started = time.perf_counter()
                single.update(rollout)
                seconds[1].append(time.perf_counter() - started)
                started = time.perf_counter()
                metrics, _, _ = group.update(rollout)
                seconds[2].append(time.perf_counter() - started)
                allreduce_ms.append(metrics["perf/allreduce_ms"])
                progress.advance(task)
        params = sum(p.numel() for p in single.params)
        transport_s = group.time_allreduce(params)
    finally:
        group.shutdown()
        ray.shutdown()
    sps_1, sps_2 = (samples / statistics.median(seconds[n]) for n in (1, 2))
    steps = CONFIG["num_minibatches"] * CONFIG["update_epochs"]
    per_update_ms = statistics.median(allreduce_ms)
    gradient_bytes = params * 4
    print(
        json.dumps(
            {
                "sps_1": round(sps_1),
                "sps_2": round(sps_2),
                "efficiency": round(sps_2 / (2 * sps_1), 3),
                "allreduce_ms_per_update": round(per_update_ms, 2),
                "allreduce_bytes_per_update": metrics["perf/allreduce_bytes"],
                "allreduce_share_of_update": round(per_update_ms / (samples / sps_2 * 1000.0), 3),
                "gradient_bytes": gradient_bytes,
                "optimiser_steps_per_update": steps,
                # per optimiser step: one gradient and one statistics all-reduce, each also waiting on the slower
                # learner; the transport alone (after a barrier) moves 2(N-1)/N x the gradient bytes per learner
                "allreduce_ms_per_step": round(per_update_ms / steps, 3),
                "transport_ms_per_gradient": round(transport_s * 1000.0, 3),
                "ring_bytes_per_s": round(gradient_bytes * 2 * (2 - 1) / 2 / transport_s),
                "params": params,
                "batch": rollout.num_steps,
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "machine": "2 cores shared with other engineers' jobs (not quiet)",
                "command": f"python bench/learner_scaling.py --updates {args.updates}",
            }
        )
    )


if __name__ == "__main__":
    main()
