"""PPO on CartPole-v1: our PPO against Stable-Baselines3 (RL-Zoo settings), same machine, same command.

Both run with the same torch thread count, several seeds each. Throughput (``*_sps``) is env steps per second
of training wall time (evaluations excluded); solve time is the wall time from the start of training until a
deterministic evaluation (10 episodes, seeds 10000..10009, one shared evaluator) averages >= 475, evaluations
included. A run that does not solve (within its time budget; SB3 also within RL-Zoo's 100k steps, where its
linear schedules end) counts as never solving: a median that lands on such a run is reported as null.
Final line: {"ours_sps", "sb3_sps", "sps_ratio", "ours_solve_s_median", "sb3_solve_s_median", "ours_eval_return", ...}

    .venv/bin/python bench/ppo_throughput.py [--seeds 3] [--threads 1] [--ours-budget 60] [--sb3-budget 240]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
from rich.progress import Progress

SOLVED, EVAL_EPISODES, EVAL_SEED = 475.0, 10, 10_000
# Ours: many vectorised envs (gymnasium's CartPoleVectorEnv), large batches, numpy rollouts.
# The LR anneals over total_steps, so it is set well past the ~0.1-0.4 M steps a solve takes.
OURS = dict(
    num_envs=256,
    n_steps=16,
    learning_rate=2e-3,
    gamma=0.99,
    gae_lambda=0.95,
    ent_coef=0.0,
    num_minibatches=2,
    update_epochs=3,
    total_steps=2_000_000,
)
# RL-Zoo's CartPole-v1 PPO hyper-parameters (rl-baselines3-zoo hyperparams/ppo.yml).
ZOO = dict(n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20, ent_coef=0.0)
ZOO_ENVS, ZOO_TIMESTEPS = 8, 100_000


def evaluate(act) -> float:
    """Mean return of EVAL_EPISODES deterministic episodes run side by side (the RL core's evaluation, for both
    sides); ``act(obs_batch) -> actions``."""
    from opentinker.agents.evaluation import evaluate_episodes

    return evaluate_episodes(
        "CartPole-v1", lambda obs: np.asarray(act(obs), dtype=np.int64), EVAL_EPISODES, EVAL_SEED
    ).mean


class SolveClock:
    """Wall clock of one run; evaluation time is kept apart so throughput excludes it."""

    def __init__(self, budget: float):
        self.budget, self.start, self.eval_s, self.solved_s, self.last_return = (
            budget,
            time.perf_counter(),
            0.0,
            None,
            0.0,
        )

    def check(self, act) -> bool:
        """Evaluate now; True when solved or out of budget (the caller stops training)."""
        t0 = time.perf_counter()
        self.last_return = evaluate(act)
        self.eval_s += time.perf_counter() - t0
        elapsed = time.perf_counter() - self.start
        if self.last_return >= SOLVED:
            self.solved_s = elapsed
        return self.solved_s is not None or elapsed > self.budget

    def train_seconds(self) -> float:
        return time.perf_counter() - self.start - self.eval_s


def run_ours(seed: int, budget: float, threads: int, config: dict) -> dict:
    from opentinker.agents import PPO

    trainer = PPO("CartPole-v1", seed=seed, device="cpu", torch_threads=threads, **config)
    policy_act = lambda obs: trainer.numpy_policy().act(obs)  # noqa: E731
    clock, last_check = SolveClock(budget), [0.0]

    def callback(metrics: dict, step: int) -> bool:
        now = time.perf_counter()
        if metrics.get("charts/episodic_return_mean", 0.0) >= 150 and now - last_check[0] > 0.2:
            last_check[0] = now
            return not clock.check(policy_act)
        return time.perf_counter() - clock.start <= budget

    trainer.train(10_000_000, callback=callback)
    sps = trainer.global_step / clock.train_seconds()
    return {"sps": sps, "solve_s": clock.solved_s, "eval_return": clock.last_return, "steps": trainer.global_step}


def run_sb3(seed: int, budget: float, threads: int) -> dict:
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    torch.set_num_threads(threads)
    linear = lambda start: lambda progress: progress * start  # noqa: E731
    model = PPO(
        "MlpPolicy",
        make_vec_env("CartPole-v1", n_envs=ZOO_ENVS, seed=seed),
        learning_rate=linear(1e-3),
        clip_range=linear(0.2),
        seed=seed,
        device="cpu",
        verbose=0,
        **ZOO,
    )
    clock = SolveClock(budget)

    class Solve(BaseCallback):
        def _on_step(self) -> bool:
            return True

        def _on_rollout_end(self) -> None:
            returns = [e["r"] for e in self.model.ep_info_buffer]
            if (
                returns
                and np.mean(returns) >= 150
                and clock.check(lambda o: self.model.predict(o, deterministic=True)[0])
            ):
                self.model._stop = True

        def _on_rollout_start(self) -> None:
            if getattr(self.model, "_stop", False) or time.perf_counter() - clock.start > budget:
                raise _Stop

    try:
        model.learn(ZOO_TIMESTEPS, callback=Solve())  # the Zoo's schedules are defined over these steps
    except _Stop:
        pass
    sps = model.num_timesteps / clock.train_seconds()
    return {"sps": sps, "solve_s": clock.solved_s, "eval_return": clock.last_return, "steps": model.num_timesteps}


class _Stop(Exception):
    """Ends SB3's learn() between rollouts."""


def median_solve(runs: list[dict]) -> float | None:
    median = statistics.median(r["solve_s"] if r["solve_s"] is not None else float("inf") for r in runs)
    return None if median == float("inf") else round(median, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both libraries")
    parser.add_argument("--ours-budget", type=float, default=60.0, help="seconds per run before giving up")
    parser.add_argument("--sb3-budget", type=float, default=240.0, help="seconds per run before giving up")
    parser.add_argument("--config", type=json.loads, default={}, help="JSON overrides of our PPO config")
    args = parser.parse_args()
    config = {**OURS, **args.config}
    ours, sb3 = [], []
    with Progress() as progress:
        task = progress.add_task("runs", total=2 * args.seeds)
        for seed in range(args.seeds):
            for name, runs, fn in (
                ("ours", ours, lambda seed=seed: run_ours(seed, args.ours_budget, args.threads, config)),
                ("sb3", sb3, lambda seed=seed: run_sb3(seed, args.sb3_budget, args.threads)),
            ):
                progress.update(task, description=f"{name} seed {seed}")
                runs.append(fn())
                rounded = {k: round(v, 2) if isinstance(v, float) else v for k, v in runs[-1].items()}
                progress.console.print(f"{name} seed {seed}: {json.dumps(rounded)}")
                progress.advance(task)
    ours_sps, sb3_sps = statistics.median(r["sps"] for r in ours), statistics.median(r["sps"] for r in sb3)
    print(
        json.dumps(
            {
                "ours_sps": round(ours_sps),
                "sb3_sps": round(sb3_sps),
                "sps_ratio": round(ours_sps / sb3_sps, 2),
                "ours_solve_s_median": median_solve(ours),
                "sb3_solve_s_median": median_solve(sb3),
                "ours_eval_return": statistics.median(r["eval_return"] for r in ours),
                "ours_solved": sum(r["solve_s"] is not None for r in ours),
                "sb3_solved": sum(r["solve_s"] is not None for r in sb3),
                "seeds": args.seeds,
                "threads": args.threads,
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "ours_config": config,
            }
        )
    )


if __name__ == "__main__":
    main()
