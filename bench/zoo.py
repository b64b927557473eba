"""The defaults against Stable-Baselines3 with RL-Zoo's published hyper-parameters, per env, same seeds and threads:

    .venv/bin/python bench/zoo.py [--seeds 3] [--threads 1] \
        [--cases cartpole-ppo,cartpole-dqn,mountaincar-dqn,pendulum-ppo]

Ours: ``PPOTrainer``/``DQNTrainer`` (the public API) with the shipped preset (``PPOTrainer(env_id)``: what ``opentinker
train ENV`` uses) and the pipeline's default horizon (``RunSpec.steps``); no tuning here. SB3: RL-Zoo's
hyper-parameters and ``n_timesteps``. Time to target: wall time from the trainer's construction until a
deterministic evaluation (10 episodes, seeds 10000..10009, one shared evaluator, run at most every
``EVAL_EVERY_S`` of training) reaches the env's ``reward_threshold`` (or RL-Zoo's reported score when the env has
none), evaluations included. A run that does not reach it within its budget counts as never reaching it. Steps/s
excludes evaluation time. Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

EVAL_EPISODES, EVAL_SEED, EVAL_EVERY_S = 10, 10_000, 0.5


def _linear(start: float) -> Callable[[float], float]:
    return lambda progress: progress * start


@dataclass(frozen=True)
class Case:
    name: str
    env_id: str
    algorithm: str
    target: float
    target_source: str
    budget_s: float
    sb3: dict[str, Any] = field(default_factory=dict)
    sb3_envs: int = 1
    sb3_steps: int = 100_000


# RL-Zoo hyper-parameters (rl-baselines3-zoo hyperparams/{ppo,dqn}.yml) and reported scores (benchmark.md).
CASES = {
    "cartpole-ppo": Case(
        "cartpole-ppo",
        "CartPole-v1",
        "ppo",
        475.0,
        "reward_threshold",
        120.0,
        dict(
            n_steps=32,
            batch_size=256,
            gae_lambda=0.8,
            gamma=0.98,
            n_epochs=20,
            ent_coef=0.0,
            learning_rate=("lin", 1e-3),
            clip_range=("lin", 0.2),
        ),
        8,
        100_000,
    ),
    "cartpole-dqn": Case(
        "cartpole-dqn",
        "CartPole-v1",
        "dqn",
        475.0,
        "reward_threshold",
        240.0,
        dict(
            learning_rate=2.3e-3,
            batch_size=64,
            buffer_size=100_000,
            learning_starts=1000,
            gamma=0.99,
            target_update_interval=10,
            train_freq=256,
            gradient_steps=128,
            exploration_fraction=0.16,
            exploration_final_eps=0.04,
            policy_kwargs=dict(net_arch=[256, 256]),
        ),
        1,
        50_000,
    ),
    "mountaincar-dqn": Case(
        "mountaincar-dqn",
        "MountainCar-v0",
        "dqn",
        -110.0,
        "reward_threshold",
        420.0,
        dict(
            learning_rate=4e-3,
            batch_size=128,
            buffer_size=10_000,
            learning_starts=1000,
            gamma=0.98,
            target_update_interval=600,
            train_freq=16,
            gradient_steps=8,
            exploration_fraction=0.2,
            exploration_final_eps=0.07,
            policy_kwargs=dict(net_arch=[256, 256]),
        ),
        1,
        120_000,
    ),
    "pendulum-ppo": Case(
        "pendulum-ppo",
        "Pendulum-v1",
        "ppo",
        -172.225,
        "RL-Zoo score",
        360.0,
        dict(
            n_steps=1024,
            gae_lambda=0.95,
            gamma=0.9,
            n_epochs=10,
            ent_coef=0.0,
            learning_rate=1e-3,
            clip_range=0.2,
            use_sde=True,
            sde_sample_freq=4,
        ),
        4,
        100_000,
    ),
}


def evaluate(env_id: str, act: Callable[[np.ndarray], np.ndarray]) -> float:
    """Mean return of EVAL_EPISODES deterministic episodes side by side (the RL core's evaluation, for both sides);
    ``act(obs_batch) -> actions``."""
    from opentinker.agents.evaluation import evaluate_episodes

    return evaluate_episodes(env_id, act, EVAL_EPISODES, EVAL_SEED).mean


class Clock:
    """One run's wall clock; evaluation time is kept apart so steps/s excludes it."""

    def __init__(self, case: Case):
        self.case, self.start, self.eval_s, self.reached_s, self.last_eval = case, time.perf_counter(), 0.0, None, 0.0
        self.last_return = -math.inf

    def due(self) -> bool:
        return time.perf_counter() - self.last_eval >= EVAL_EVERY_S

    def check(self, act) -> bool:
        """Evaluate now; True when the target is reached or the budget is spent (the caller stops training)."""
        t0 = time.perf_counter()
        self.last_return = evaluate(self.case.env_id, act)
        self.last_eval = time.perf_counter()
        self.eval_s += self.last_eval - t0
        if self.last_return >= self.case.target and self.reached_s is None:
            self.reached_s = self.last_eval - self.start
        return self.reached_s is not None or self.over_budget()

    def over_budget(self) -> bool:
        return time.perf_counter() - self.start > self.case.budget_s

    def train_seconds(self) -> float:
        return time.perf_counter() - self.start - self.eval_s


def run_ours(case: Case, seed: int, threads: int) -> dict:
    from opentinker import DQNTrainer, PPOTrainer
    from opentinker.tasks.spec import RunSpec

    steps = RunSpec(env_id=case.env_id, algorithm=case.algorithm).steps  # the pipeline's default horizon
    clock = Clock(case)
    trainer = {"ppo": PPOTrainer, "dqn": DQNTrainer}[case.algorithm](  # an env id: the CLI's preset
        case.env_id, seed=seed, device="cpu", torch_threads=threads, backend="local"
    )

    def callback(metrics: dict, step: int) -> bool:
        return not (clock.due() and clock.check(trainer.numpy_policy().act)) and not clock.over_budget()

    trainer.train(steps, callback=callback)
    sps = trainer.global_step / clock.train_seconds()
    final = evaluate(case.env_id, trainer.numpy_policy().act)
    trainer.env.close()
    return {"reached_s": clock.reached_s, "final_eval": final, "sps": sps, "steps": trainer.global_step}


def run_sb3(case: Case, seed: int, threads: int) -> dict:
    import stable_baselines3
    import torch
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    torch.set_num_threads(threads)
    kwargs = {k: _linear(v[1]) if isinstance(v, tuple) else v for k, v in case.sb3.items()}
    algo = getattr(stable_baselines3, case.algorithm.upper())
    clock = Clock(case)
    model = algo(
        "MlpPolicy",
        make_vec_env(case.env_id, n_envs=case.sb3_envs, seed=seed),
        seed=seed,
        device="cpu",
        verbose=0,
        **kwargs,
    )
    act = lambda obs: model.predict(obs, deterministic=True)[0]  # noqa: E731

    class Stop(BaseCallback):
        def _on_step(self) -> bool:
            return not clock.over_budget() and not getattr(self, "done", False)

        def _on_rollout_end(self) -> None:
            self.done = clock.due() and clock.check(act)

    model.learn(case.sb3_steps, callback=Stop())
    sps = model.num_timesteps / clock.train_seconds()
    return {
        "reached_s": clock.reached_s,
        "final_eval": evaluate(case.env_id, act),
        "sps": sps,
        "steps": model.num_timesteps,
    }


def median_time(runs: list[dict]) -> float:
    return statistics.median(r["reached_s"] if r["reached_s"] is not None else math.inf for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both libraries")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    rows = {}
    for name in args.cases.split(","):
        case, ours, sb3 = CASES[name], [], []
        for seed in range(args.seeds):
            for side, runs, fn in (("ours", ours, run_ours), ("sb3", sb3, run_sb3)):
                runs.append(fn(case, seed, args.threads))
                console.print(
                    f"{name} {side} seed {seed}: "
                    + json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in runs[-1].items()})
                )
        ours_t, sb3_t = median_time(ours), median_time(sb3)
        rows[name] = {
            "env_id": case.env_id,
            "algorithm": case.algorithm,
            "target": case.target,
            "target_source": case.target_source,
            "ours_time_s": None if math.isinf(ours_t) else round(ours_t, 2),
            "sb3_time_s": None if math.isinf(sb3_t) else round(sb3_t, 2),
            "time_ratio": None if math.isinf(ours_t) or math.isinf(sb3_t) else round(ours_t / sb3_t, 3),
            "ours_reached": sum(r["reached_s"] is not None for r in ours),
            "sb3_reached": sum(r["reached_s"] is not None for r in sb3),
            "ours_final_eval": round(statistics.median(r["final_eval"] for r in ours), 1),
            "sb3_final_eval": round(statistics.median(r["final_eval"] for r in sb3), 1),
            "ours_sps": round(statistics.median(r["sps"] for r in ours)),
            "sb3_sps": round(statistics.median(r["sps"] for r in sb3)),
        }
        rows[name]["sps_ratio"] = round(rows[name]["ours_sps"] / rows[name]["sb3_sps"], 2)
    table = Table(title=f"zoo: time to target, {args.seeds} seed(s), {args.threads} torch thread(s)")
    columns = ("case", "target", "ours s", "SB3 s", "ratio", "reached", "final eval (ours/SB3)", "steps/s (ours/SB3)")
    for column in columns:
        table.add_column(column)
    for name, r in rows.items():
        table.add_row(
            name,
            f"{r['target']:g} ({r['target_source']})",
            str(r["ours_time_s"]),
            str(r["sb3_time_s"]),
            str(r["time_ratio"]),
            f"{r['ours_reached']}/{r['sb3_reached']} of {args.seeds}",
            f"{r['ours_final_eval']} / {r['sb3_final_eval']}",
            f"{r['ours_sps']} / {r['sb3_sps']}",
        )
    console.print(table)
    ratios = [r["time_ratio"] for r in rows.values()]
    print(
        json.dumps(
            {
                "cases": rows,
                "seeds": args.seeds,
                "threads": args.threads,
                "median_time_ratio": None if None in ratios else statistics.median(ratios),
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "rerun": f"python bench/zoo.py --seeds {args.seeds} --threads {args.threads} --cases {args.cases}",
            }
        )
    )


if __name__ == "__main__":
    main()
