"""Overhead of the orchestrated pipeline over the bare engine loop, same PPO steps and seed.

    .venv/bin/python bench/pipeline_overhead.py --steps 1000000

Both sides train on the same Ray rollout actors' configuration (RemoteEnv, ray backend) in one process,
after Ray is up. ``bare_s`` is ``PPOTrainer.train(steps)`` with no callback; ``flow_s`` is the same loop
inside ``train_flow``'s training task (per-iteration MLflow metrics, system sampling, progress). Fixed
start-up — Prefect's API server, the MLflow run, the probe rollout, evaluation, registration, plots and
uploads, none of which grow with ``steps`` — is reported separately as ``flow_fixed_s``. The last line is JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000, help="PPO env steps for each side.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-envs", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--n-steps", type=int, default=16, help="PPOConfig.n_steps (steps per env per iteration).")
    args = parser.parse_args()

    os.environ.setdefault("OPENTINKER_DATA_DIR", tempfile.mkdtemp(prefix="opentinker-bench-"))
    os.environ.setdefault("PREFECT_HOME", os.path.join(os.environ["OPENTINKER_DATA_DIR"], "prefect"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    import opentinker.tasks  # noqa: F401  (Prefect defaults)
    from opentinker.agents import PPOTrainer
    from opentinker.envs import RemoteEnv
    from opentinker.flows.params import TrainParams
    from opentinker.flows.train import train_flow
    from opentinker.infra.ray_runtime import ensure_ray

    started = time.perf_counter()
    ensure_ray()
    ray_start_s = time.perf_counter() - started
    ppo = {"n_steps": args.n_steps}

    env = RemoteEnv("CartPole-v1", parallel=args.num_envs, workers=args.workers, backend="ray", seed=args.seed)
    trainer = PPOTrainer(env, seed=args.seed, **ppo)
    started = time.perf_counter()
    trainer.train(args.steps)
    bare_s = time.perf_counter() - started
    env.close()
    print(f"bare engine loop: {bare_s:.1f} s for {trainer.global_step:,} steps", file=sys.stderr)

    params = TrainParams(env_id="CartPole-v1", steps=args.steps, seed=args.seed, num_envs=args.num_envs,
                         workers=args.workers, ppo=ppo, run_name="bench", model_name="bench-cartpole")
    started = time.perf_counter()
    result = train_flow(params)
    flow_total_s = time.perf_counter() - started
    flow_s = result.train_seconds
    print(f"train_flow: {flow_total_s:.1f} s in total, {flow_s:.1f} s in the training loop", file=sys.stderr)

    print(json.dumps({
        "steps": args.steps,
        "bare_s": round(bare_s, 2),
        "flow_s": round(flow_s, 2),
        "overhead_ratio": round(flow_s / bare_s, 4),
        "flow_total_s": round(flow_total_s, 2),
        "flow_fixed_s": round(flow_total_s - flow_s, 2),
        "ray_start_s": round(ray_start_s, 2),
        "eval_mean": result.eval_mean,
    }))


if __name__ == "__main__":
    main()
