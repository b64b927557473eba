"""The defaults against Stable-Baselines3 with RL-Zoo's (or CleanRL's) hyper-parameters, per env, same seeds and
threads, both sides in one command:

    .venv/bin/python bench/zoo.py [--seeds N] [--threads 1] [--cases cartpole-ppo,halfcheetah-sac,...] [--to-budget]
        [--max-steps N] [--sides ours]  # caps every budget (smoke tests); one side only (a learning check)

Ours: the public trainers (``PPOTrainer``, ``DQNTrainer``, ``SACTrainer``) given the env id, so with the shipped
preset (what ``opentinker train ENV`` uses), and the pipeline's default horizon (``RunSpec.steps``) for schedules; no
tuning here. SB3: RL-Zoo's hyper-parameters (CleanRL's ``ppo_atari.py`` for Breakout), on the same env
(``make_env``: for Atari ids gymnasium's ``AtariPreprocessing`` and 4 stacked frames).

Repeatable by construction: both sides are evaluated after the same env steps (every ``eval_every``: 10 deterministic
episodes, seeds 10000..10009, the RL core's one evaluation function), and evaluation time is kept out of both clocks.
Time to target: training seconds (construction included) until the first evaluation at or above the target (the env's
``reward_threshold``, or the score named in the case); a run that does not reach it within its env-step budget counts
as never reaching it (SB3: RL-Zoo's ``n_timesteps``, where its schedules end; ours: the run ``opentinker train ENV``
makes, ``RunSpec.steps``; the SAC cases: the issue's 100k for both); where only SB3 never reaches it, the ratio is
ours over SB3's time for its whole budget, an upper bound (printed "< x"). By default a run stops at its target
(``--to-budget`` trains on to the budget, for the return there). Breakout has no target: ours trains its budget of env
steps, SB3 then trains for the same training seconds, and both are evaluated at the end (the return each reaches in
equal wall time). Each case runs its default seeds (5 for the cases that take seconds) unless ``--seeds`` says
otherwise; every seed's figures are printed, then a table (medians, per-seed range) and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from zoo_cases import CASES, Case  # bench/ is sys.path[0]

EVAL_EPISODES, EVAL_SEED = 10, 10_000


def evaluate(case: Case, act: Callable[[np.ndarray], np.ndarray]) -> float:
    """Mean return of EVAL_EPISODES deterministic episodes side by side (the RL core's evaluation, for both sides);
    ``act(obs_batch) -> actions``."""
    from opentinker.agents.evaluation import evaluate_episodes

    return evaluate_episodes(case.env_id, act, EVAL_EPISODES, EVAL_SEED, **case.eval_kwargs).mean


class Clock:
    """One run's training clock (evaluations excluded) and its evaluations at fixed env steps."""

    def __init__(self, case: Case, to_budget: bool, train_seconds: float | None = None):
        self.case, self.to_budget, self.limit_s = case, to_budget, train_seconds
        self.start, self.eval_s = time.perf_counter(), 0.0
        self.next_eval, self.reached_s, self.reached_step = case.eval_every, None, None
        self.evals: list[tuple[int, float]] = []

    def train_seconds(self) -> float:
        return time.perf_counter() - self.start - self.eval_s

    def at_step(self, step: int, act: Callable) -> bool:
        """Called after each update with the side's env steps so far: evaluates when one is due; True to stop
        (target reached, or an equal-time run out of time)."""
        if self.limit_s is not None and self.train_seconds() >= self.limit_s:
            return True
        if step < self.next_eval:
            return False
        self.next_eval = (step // self.case.eval_every + 1) * self.case.eval_every
        return self.evaluate(step, act) and not self.to_budget

    def evaluate(self, step: int, act: Callable) -> bool:
        """Evaluate now (off the clock); True when the target is reached."""
        trained, t0 = self.train_seconds(), time.perf_counter()
        mean = evaluate(self.case, act)
        self.eval_s += time.perf_counter() - t0
        self.evals.append((step, round(mean, 1)))
        if self.case.target is not None and mean >= self.case.target and self.reached_s is None:
            self.reached_s, self.reached_step = trained, step
        return self.reached_s is not None

    def result(self, steps: int, act: Callable) -> dict:
        """The run's figures, with a final evaluation where it stopped (unless one was just taken there)."""
        seconds = self.train_seconds()
        if not self.evals or self.evals[-1][0] != steps:
            self.evaluate(steps, act)
        return {
            "reached_s": self.reached_s,
            "reached_step": self.reached_step,
            "final_eval": self.evals[-1][1],
            "steps": steps,
            "train_s": seconds,
            "sps": steps / seconds,
            "evals": self.evals,
        }


def run_ours(case: Case, seed: int, threads: int, to_budget: bool, train_seconds: float | None = None) -> dict:
    import opentinker
    from opentinker.tasks.spec import RunSpec

    horizon = RunSpec(env_id=case.env_id, algorithm=case.algorithm).steps  # the pipeline's default horizon
    budget = case.ours_budget or max(horizon, case.budget_steps)
    clock = Clock(case, to_budget, train_seconds)
    trainer = getattr(opentinker, f"{case.algorithm.upper()}Trainer")(  # an env id: the CLI's preset
        case.env_id, seed=seed, device="cpu", torch_threads=threads, backend="local"
    )
    act = lambda obs: trainer.numpy_policy().act(obs)  # noqa: E731

    def callback(metrics: dict, step: int) -> bool:
        return not clock.at_step(step, act) and step < budget

    trainer.train(max(horizon, budget), callback=callback)
    result = clock.result(trainer.global_step, act)
    trainer.env.close()
    return result


def run_sb3(case: Case, seed: int, threads: int, to_budget: bool, train_seconds: float | None = None) -> dict:
    import stable_baselines3
    import torch
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    from opentinker.envs import make_env

    torch.set_num_threads(threads)
    kwargs = {k: (lambda progress, x=v[1]: progress * x) if isinstance(v, tuple) else v for k, v in case.sb3.items()}
    clock = Clock(case, to_budget, train_seconds)
    env = make_vec_env(functools.partial(make_env, case.env_id), n_envs=case.sb3_envs, seed=seed)
    algo = getattr(stable_baselines3, case.algorithm.upper())
    model = algo(case.sb3_policy, env, seed=seed, device="cpu", verbose=0, **kwargs)
    act = lambda obs: model.predict(obs, deterministic=True)[0]  # noqa: E731

    class AtSteps(BaseCallback):
        """Evaluates after each update (a rollout starts once the previous one was trained on)."""

        stop = False

        def _on_rollout_start(self) -> None:
            self.stop = self.stop or clock.at_step(self.num_timesteps, act)

        def _on_step(self) -> bool:
            return not (self.stop or (train_seconds is not None and clock.train_seconds() >= train_seconds))

    budget = case.budget_steps if train_seconds is None else 10**9
    model.learn(budget, callback=AtSteps())
    result = clock.result(model.num_timesteps, act)
    env.close()
    return result


def summary(case: Case, ours: list[dict], sb3: list[dict]) -> dict:
    """Medians over seeds with every seed's figure; time ratio = median of ours / median of SB3 (SB3 not reaching
    the target within its budget: ours / SB3's time for the whole budget, an upper bound, marked so)."""
    row: dict[str, Any] = {"env_id": case.env_id, "algorithm": case.algorithm, "target": case.target}
    row["target_source"] = case.target_source
    for side, runs in (("ours", ours), ("sb3", sb3)):
        row[f"{side}_sps"] = round(statistics.median(r["sps"] for r in runs))
        row[f"{side}_final_eval"] = round(statistics.median(r["final_eval"] for r in runs), 1)
        row[f"{side}_final_evals"] = [r["final_eval"] for r in runs]
        row[f"{side}_steps"] = [r["steps"] for r in runs]
        if case.target is not None:
            row[f"{side}_times_s"] = [None if r["reached_s"] is None else round(r["reached_s"], 2) for r in runs]
            row[f"{side}_reached"] = sum(r["reached_s"] is not None for r in runs)
            row[f"{side}_time_s"] = ranked_median(row[f"{side}_times_s"])
    row["sps_ratio"] = round(row["ours_sps"] / row["sb3_sps"], 2)
    if case.target is not None:
        ours_t, sb3_t = row["ours_time_s"], row["sb3_time_s"]
        row["time_ratio"] = None if ours_t is None or sb3_t is None else round(ours_t / sb3_t, 3)
        if ours_t is not None and sb3_t is None:  # SB3 took longer than its whole budget: an upper bound
            budget_s = statistics.median(r["train_s"] for r in sb3 if r["reached_s"] is None)
            row["time_ratio"], row["time_ratio_bound"] = round(ours_t / budget_s, 3), "upper"
    else:
        row["train_s"] = round(statistics.median(r["train_s"] for r in ours), 1)
    return row


def ranked_median(values: list[float | None]) -> float | None:
    """The median with a run that never reached the target (None) ranked last; None when that median is a miss."""
    median = statistics.median(math.inf if v is None else v for v in values)
    return None if math.isinf(median) else median


def spread(values: list[float | None]) -> str:
    """Median (a run that never reached the target ranks last, as in the time ratio) and the reached runs' range."""
    reached = [v for v in values if v is not None]
    median = ranked_median(values)
    text = "never" if median is None else f"{median:g}"
    missed = len(values) - len(reached)
    if len(values) > 1 and reached:
        text += f" ({min(reached):g}-{max(reached):g}{f', {missed} never' if missed else ''})"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=None, help="seeds per case (default: each case's own)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both libraries")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    parser.add_argument("--to-budget", action="store_true", help="train on to the budget after the target")
    parser.add_argument("--max-steps", type=int, default=None, help="cap every budget (smoke tests)")
    parser.add_argument("--sides", default="ours,sb3", help="ours,sb3 (default) or one of them: a learning check")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True, width=160)
    names = args.cases.split(",")
    sides = args.sides.split(",")
    if not sides or any(side not in ("ours", "sb3") for side in sides):
        parser.error(f"--sides: expected ours, sb3 or both, got {args.sides!r}")
    unknown = [name for name in names if name not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; expected some of {', '.join(CASES)}")
    rows = {}
    import stable_baselines3  # noqa: F401  (imports and first env builds stay off both clocks)

    import opentinker
    from opentinker.envs import make_env

    for name in names:  # a throw-away trainer of each case: imports, env registration, first-call inits
        case = CASES[name]
        getattr(opentinker, f"{case.algorithm.upper()}Trainer")(case.env_id, backend="local").env.close()
        make_env(case.env_id).close()
    for name in names:
        case, ours, sb3 = CASES[name], [], []
        if args.max_steps:
            case = dataclasses.replace(
                case, budget_steps=min(case.budget_steps, args.max_steps), ours_budget=args.max_steps
            )
        for seed in range(args.seeds or case.seeds):
            if "ours" in sides:
                ours.append(run_ours(case, seed, args.threads, args.to_budget))
            if "sb3" in sides:
                equal_time = None if case.target is not None or not ours else ours[-1]["train_s"]
                sb3.append(run_sb3(case, seed, args.threads, args.to_budget, equal_time))
            for side, runs in (("ours", ours), ("sb3", sb3)):
                if side in sides:
                    shown = {k: round(v, 2) if isinstance(v, float) else v for k, v in runs[-1].items()}
                    console.print(f"{name} {side} seed {seed}: {json.dumps(shown)}")
        if len(sides) == 1:  # a learning check of one side: its runs are the output
            continue
        rows[name] = summary(case, ours, sb3)
    table = Table(title=f"zoo: {args.threads} torch thread(s); medians over seeds (per-seed range)")
    for column in ("case", "target", "ours s", "SB3 s", "ratio", "final eval ours / SB3", "steps/s ours / SB3"):
        table.add_column(column)
    for name, r in rows.items():
        timed = r["target"] is not None
        table.add_row(
            name,
            f"{r['target']:g} ({r['target_source']})" if timed else f"{r['train_s']} s each",
            spread(r["ours_times_s"]) if timed else "-",
            spread(r["sb3_times_s"]) if timed else "-",
            ("< " if r.get("time_ratio_bound") else "") + str(r.get("time_ratio", "-")),
            f"{spread(r['ours_final_evals'])} / {spread(r['sb3_final_evals'])}",
            f"{r['ours_sps']} / {r['sb3_sps']}",
        )
    console.print(table)
    ratios = [r["time_ratio"] for r in rows.values() if "time_ratio" in r]
    rerun = f"python bench/zoo.py --threads {args.threads} --cases {args.cases}"
    rerun += (f" --seeds {args.seeds}" if args.seeds else "") + (" --to-budget" if args.to_budget else "")
    rerun += f" --max-steps {args.max_steps}" if args.max_steps else ""
    rerun += f" --sides {args.sides}" if len(sides) == 1 else ""
    print(
        json.dumps(
            {
                "cases": rows,
                "threads": args.threads,
                "median_time_ratio": None if not ratios or None in ratios else statistics.median(ratios),
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "rerun": rerun,
            }
        )
    )


if __name__ == "__main__":
    main()
