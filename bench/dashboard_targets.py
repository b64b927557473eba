"""The article's dashboard targets on the quickstart's algorithm settings: rollout efficiency > 85 %, gradient delay
< 50 ms, per rollout backend, and the remedy the run's dashboard would name.

    .venv/bin/python bench/dashboard_targets.py --steps 40960

Same PPO defaults and ``parallel`` (the quickstart's 8 CartPole copies) on the in-process backend (the reference)
and on Ray actors (what the quickstart's train task uses today); medians over the iterations after the first three.
The last line is JSON; ``sps_ratio`` is Ray's throughput over the reference's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

KEYS = ("perf/rollout_efficiency", "perf/rollout_worker_share", "perf/gradient_delay_ms", "perf/update_ms")


def measure(backend: str, parallel: int, steps: int) -> dict:
    from opentinker import PPOTrainer, RemoteEnv
    from opentinker.tracking.remedies import dashboard_remedies

    env = RemoteEnv("CartPole-v1", parallel=parallel, backend=backend)
    try:
        trainer = PPOTrainer(env, policy="MLP", device="cpu")
        rows: list[dict] = []
        start = time.perf_counter()
        trainer.train(steps=steps, callback=lambda metrics, step: rows.append(metrics))
        sps = trainer.global_step / (time.perf_counter() - start)
    finally:
        env.close()
    rows = rows[3:]
    figures = {key.split("/")[1]: round(statistics.median(r[key] for r in rows if key in r), 3) for key in KEYS}
    return {**figures, "sps": round(sps), "remedies": dashboard_remedies(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40_960)
    parser.add_argument("--parallel", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("OPENTINKER_DATA_DIR", tempfile.mkdtemp(prefix="opentinker-bench-"))
    local = measure("local", args.parallel, args.steps)
    ray = measure("ray", args.parallel, args.steps)
    print(f"local: {local}\nray:   {ray}")
    print(
        json.dumps(
            {
                "local": local,
                "ray": ray,
                "sps_ratio": round(ray["sps"] / local["sps"], 3),
                "load_average": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
