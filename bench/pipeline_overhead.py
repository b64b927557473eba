"""Whole train_flow run against the bare RL core, same PPO config (the CartPole preset) on the RL core's fastest
backend, and what starting training ahead of the flow buys, one command:

    .venv/bin/python bench/pipeline_overhead.py --steps 1000000

``bare_s``: ``PPO("CartPole-v1", config=<the resolved preset>)`` built and trained for ``steps`` (gymnasium's vectorised
CartPole in-process, the RL core's fastest path), then evaluated. ``flow_s``: the train flow as ``opentinker train``
runs it (``run_train_flow``: training starts in its own process while the data dir's Prefect server is found) from the
call to its result, fixed start-up and wrap-up included (the Prefect flow run, the MLflow run, the probe rollout,
evaluation, registration, gate, plots, uploads). torch is imported first, as in the warm process the flows' training
children fork from. ``ratio = flow_s / bare_s``; the floor is 1.10, and ``flow_fixed_s`` (the flow's seconds outside its
training loop) ≤ 2 s. ``bare_s`` is the median of a bare run before the flows and one after each, so a change in machine
load hits both sides. ``plain_flow_s``: the same spec through ``train_flow`` alone (training starts inside the flow
run); ``early_gain_s = plain_flow_s - flow_s``. Every flow runs in a fresh process, as each ``opentinker train`` does,
on one data dir, as a user's later runs do: a first small ``opentinker train`` there (``first_run_s``, its whole
command: the MLflow store made, the data dir's Prefect server started, its warm processes started as it ends)
comes before the timed flows, which start once that process listens (``warm_training``: a user's next run comes seconds
later; their training children fork from it, ``tasks.fork_server``), and what it left is stopped at the end. ``--pairs``
plain/early pairs run alternately (medians reported), so neither side always runs first. Then ``--commands`` whole
``opentinker train --steps 20000`` commands as a user types them (forks of the data dir's warm flow process, which the
first run started: ``warm_flow``), each followed by a bare run of the same steps: ``command_over_training_s`` is the
median command's seconds beyond the median bare run's (floor 5 s). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def spec(steps: int, seed: int):
    from opentinker.flows.presets import resolve_spec
    from opentinker.tasks.spec import RunSpec

    run = RunSpec(env_id="CartPole-v1", steps=steps, seed=seed, run_name="bench", model_name="bench-cartpole")
    return resolve_spec(run)


def flow(variant: str, steps: int, seed: int) -> None:
    """One flow run in this (fresh) process; prints its figures as JSON."""
    from opentinker.flows.train import prefect_api_starting, run_train_flow, train_flow
    from opentinker.tasks import prefect_defaults

    prefect_defaults()
    resolved = spec(steps, seed)
    started = time.perf_counter()
    if variant == "early":
        result = run_train_flow(resolved)
    else:
        with prefect_api_starting():  # the same Prefect server as the early flow's
            pass
        result = train_flow(resolved)
    seconds = time.perf_counter() - started
    print(json.dumps({"flow_s": seconds, "train_s": result.train_seconds, "eval_mean": result.eval_mean}))


def flow_env(data: str) -> dict[str, str]:
    """A flow process's environment: the bench's data dir, no Prefect API configured (the data dir's own server)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "OPENTINKER_PREFECT_API_URL")}
    return {**env, "OPENTINKER_DATA_DIR": data, "PREFECT_HOME": os.path.join(data, "prefect-client")}


def first_run(data: str) -> float:
    """The first ``opentinker train`` in the data dir (2,048 steps), whole command: what later runs no longer pay."""
    opentinker = os.path.join(os.path.dirname(sys.executable), "opentinker")
    started = time.perf_counter()
    command = [opentinker, "train", "CartPole-v1", "--steps", "2048", "--seed", "99"]
    subprocess.run(command, env=flow_env(data), capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - started
    print(f"first opentinker train in the data dir (2,048 steps): {seconds:.1f} s", file=sys.stderr)
    return seconds


def command(data: str, steps: int, seed: int) -> float:
    """One whole ``opentinker train CartPole-v1 --steps STEPS`` in the data dir, as a user types it: its wall
    seconds (a fork of the data dir's warm flow process, when it listens)."""
    opentinker = os.path.join(os.path.dirname(sys.executable), "opentinker")
    started = time.perf_counter()
    argv = [opentinker, "train", "CartPole-v1", "--steps", str(steps), "--seed", str(seed)]
    subprocess.run(argv, env=flow_env(data), capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - started
    print(f"opentinker train ({steps:,} steps): {seconds:.2f} s", file=sys.stderr)
    return seconds


def run_flow(variant: str, steps: int, seed: int, data: str) -> dict:
    env = {**flow_env(data), "PREFECT_LOGGING_LEVEL": "WARNING"}
    command = [sys.executable, __file__, "--flow", variant, "--steps", str(steps), "--seed", str(seed)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"train_flow ({variant} training): {figures['flow_s']:.1f} s, {figures['train_s']:.1f} s in the loop",
        file=sys.stderr,
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000, help="PPO env steps for each side.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pairs", type=int, default=2, help="plain/early flow pairs, run alternately.")
    parser.add_argument("--commands", type=int, default=3, help="whole `opentinker train` commands after the flows.")
    parser.add_argument("--command-steps", type=int, default=20_000, help="env steps of each of those commands.")
    parser.add_argument("--flow", choices=("early", "plain"), help=argparse.SUPPRESS)  # one flow run (a child)
    args = parser.parse_args()
    if args.flow:
        flow(args.flow, args.steps, args.seed)
        return

    data = os.environ.setdefault("OPENTINKER_DATA_DIR", tempfile.mkdtemp(prefix="opentinker-bench-"))
    from pathlib import Path

    from opentinker.agents import PPO
    from opentinker.infra.local_prefect import stop_local_prefect
    from opentinker.infra.settings import Settings
    from opentinker.tasks import fork_server

    resolved = spec(args.steps, args.seed)

    def bare(steps: int = args.steps) -> tuple[float, float]:
        started = time.perf_counter()
        trainer = PPO("CartPole-v1", seed=args.seed, config=resolved.engine.config())
        trainer.train(steps)
        mean = trainer.evaluate(resolved.eval_episodes, resolved.eval_seed).mean
        trainer.env.close()
        seconds = time.perf_counter() - started
        engine = resolved.engine
        print(
            f"bare RL core ({engine.backend}, {engine.num_envs} envs): {seconds:.1f} s, eval {mean:.1f}",
            file=sys.stderr,
        )
        return seconds, mean

    import torch._dynamo  # noqa: F401  (the first optimiser's import, loaded in the flows' warm process too)

    first_bare_s, bare_eval = bare()
    bare_runs = [first_bare_s]
    runs: dict[str, list[dict]] = {"plain": [], "early": []}
    try:
        first_s = first_run(data)
        warm = fork_server.wait_ready(Path(data), timeout=120)
        warm_flow = fork_server.wait_ready(Path(data), 120, fork_server.FLOW, flow_env(data))
        for pair in range(args.pairs):
            for variant in ("plain", "early") if pair % 2 == 0 else ("early", "plain"):
                runs[variant].append(run_flow(variant, args.steps, args.seed, data))
                bare_runs.append(bare()[0])  # a bare run after every flow: the machine's speed drifts by 20 %
        commands_s, bare_command_s = [], []
        for index in range(args.commands):
            commands_s.append(command(data, args.command_steps, 1000 + index))
            bare_command_s.append(bare(args.command_steps)[0])
    finally:
        stop_local_prefect(Settings(data_dir=data))
        fork_server.stop_servers(Path(data))
    early = {key: statistics.median(run[key] for run in runs["early"]) for key in runs["early"][0]}
    plain = {key: statistics.median(run[key] for run in runs["plain"]) for key in runs["plain"][0]}
    bare_s = statistics.median(bare_runs)
    print(
        json.dumps(
            {
                "steps": args.steps,
                "backend": resolved.engine.backend,
                "num_envs": resolved.engine.num_envs,
                "bare_s": round(bare_s, 2),
                "bare_runs_s": [round(seconds, 2) for seconds in bare_runs],
                "flow_s": round(early["flow_s"], 2),  # early: what `opentinker train` runs
                "flow_runs_s": [round(run["flow_s"], 2) for run in runs["early"]],
                "plain_flow_runs_s": [round(run["flow_s"], 2) for run in runs["plain"]],
                "ratio": round(early["flow_s"] / bare_s, 4),
                "flow_train_loop_s": round(early["train_s"], 2),
                "flow_fixed_s": round(early["flow_s"] - early["train_s"], 2),
                "plain_flow_s": round(plain["flow_s"], 2),
                "early_gain_s": round(plain["flow_s"] - early["flow_s"], 2),
                "first_run_s": round(first_s, 2),
                "warm_training": warm,
                "warm_flow": warm_flow,
                "command_steps": args.command_steps,
                "command_runs_s": [round(seconds, 2) for seconds in commands_s],
                "command_bare_s": round(statistics.median(bare_command_s), 2),
                "command_over_training_s": round(statistics.median(commands_s) - statistics.median(bare_command_s), 2),
                "bare_eval_mean": bare_eval,
                "flow_eval_mean": early["eval_mean"],
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "rerun": f"python bench/pipeline_overhead.py --steps {args.steps} --pairs {args.pairs} "
                f"--commands {args.commands} --command-steps {args.command_steps}",
            }
        )
    )


if __name__ == "__main__":
    main()
