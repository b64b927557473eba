"""Whole train_flow run against the bare engine, same PPO config (the CartPole preset) on the engine's fastest
backend, one command:

    .venv/bin/python bench/pipeline_overhead.py --steps 1000000

``bare_s``: ``PPOTrainer("CartPole-v1", backend="local", **preset)`` built and trained for ``steps`` (gymnasium's
vectorised CartPole in-process, the engine's fastest path), then evaluated. ``flow_s``: the train flow as
``opentinker train`` runs it (``run_train_flow``: training starts while Prefect's server starts) from the call to its
result, fixed start-up and wrap-up included (Prefect's API server, the MLflow run, the probe rollout,
evaluation, registration, gate, plots, uploads). ``ratio = flow_s / bare_s``; the floor is 1.25. ``bare_s`` is the
mean of a bare run before and one after the flow, so a change in machine load hits both sides; the last line is JSON.
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
    args = parser.parse_args()

    os.environ.setdefault("OPENTINKER_DATA_DIR", tempfile.mkdtemp(prefix="opentinker-bench-"))
    os.environ.setdefault("PREFECT_HOME", os.path.join(os.environ["OPENTINKER_DATA_DIR"], "prefect"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    from opentinker.agents import PPOTrainer
    from opentinker.flows.presets import resolve_spec
    from opentinker.tasks.spec import RunSpec

    params = RunSpec(
        env_id="CartPole-v1", steps=args.steps, seed=args.seed, run_name="bench", model_name="bench-cartpole"
    )
    resolved = resolve_spec(params).engine

    def bare() -> tuple[float, float]:
        started = time.perf_counter()
        trainer = PPOTrainer("CartPole-v1", seed=args.seed, config=resolved.config())
        trainer.train(args.steps)
        mean = trainer.evaluate(params.eval_episodes, params.eval_seed).mean
        trainer.env.close()
        seconds = time.perf_counter() - started
        print(
            f"bare engine ({resolved.backend}, {resolved.num_envs} envs): {seconds:.1f} s, eval {mean:.1f}",
            file=sys.stderr,
        )
        return seconds, mean

    before_s, bare_eval = bare()
    from opentinker.flows.train import run_train_flow
    from opentinker.tasks import prefect_defaults

    prefect_defaults()

    started = time.perf_counter()
    result = run_train_flow(params)  # what `opentinker train` runs
    flow_s = time.perf_counter() - started
    print(f"train_flow: {flow_s:.1f} s in total, {result.train_seconds:.1f} s in the training loop", file=sys.stderr)
    after_s, _ = bare()
    bare_s = (before_s + after_s) / 2  # bare runs on both sides of the flow: load drift hits both alike
    print(
        json.dumps(
            {
                "steps": args.steps,
                "backend": resolved.backend,
                "num_envs": resolved.num_envs,
                "bare_s": round(bare_s, 2),
                "bare_runs_s": [round(before_s, 2), round(after_s, 2)],
                "flow_s": round(flow_s, 2),
                "ratio": round(flow_s / bare_s, 4),
                "flow_train_loop_s": round(result.train_seconds, 2),
                "flow_fixed_s": round(flow_s - result.train_seconds, 2),
                "bare_eval_mean": bare_eval,
                "flow_eval_mean": result.eval_mean,
                "rerun": "python bench/pipeline_overhead.py --steps " + str(args.steps),
            }
        )
    )


if __name__ == "__main__":
    main()
