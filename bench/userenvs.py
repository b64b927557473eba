"""A user's own envs (``package.module:Class``, no preset) trained with the project's defaults beside
Stable-Baselines3's default PPO, at equal env steps and at equal wall time, one torch thread each:

    .venv/bin/python bench/userenvs.py [--seeds 5] [--budgets 20000,100000] [--cases vector-discrete,...]
        [--eval-episodes 50]

The envs are ``opentinker.envs.bench_envs`` (one per observation kind and per action kind). Ours: the config the CLI
resolves for ``opentinker train opentinker.envs.bench_envs:Env --steps BUDGET`` (``presets.resolve_spec``: the budget
table of docs/pipeline.md), in-process env copies (``backend="local"``). SB3: ``PPO(policy, env).learn(BUDGET)`` with
every default, ``MultiInputPolicy`` for Dict observations, ``CnnPolicy`` for images SB3's Nature CNN takes (36 pixels
a side and more), else ``MlpPolicy`` (which scales uint8 images by 1/255 too).

Per seed, SB3 trains its budget first; ours trains its budget, is evaluated (off the clock), then trains on until it
has used SB3's training seconds (at most 20x the budget): the equal-time figure. Where ours is the slower side, SB3
trains on to our time instead. Evaluation: ``--eval-episodes`` greedy episodes (and, for ours, sampled ones) on the
same seeds (10000, 10001, ...) with the RL core's one evaluation function, for both sides.

``behind``: the cases (``case@budget`` at equal steps, ``case@budget/time`` at equal time) where our median greedy
return is below SB3's by more than 10 % of the env's ``return_range`` (about a random policy's return to the best).
Every seed's figures are printed as they come, then a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import numpy as np

EVAL_SEED = 10_000
MAX_TIME_FACTOR = 20
"""An equal-time run stops at this many times the budget's env steps, whatever time is left."""


def env_ref(cls: type) -> str:
    return f"{cls.__module__}:{cls.__name__}"


def sb3_policy(env: Any) -> str:
    import gymnasium as gym

    from opentinker.envs.spaces import image_layout

    space = env.observation_space
    if isinstance(space, gym.spaces.Dict):
        return "MultiInputPolicy"
    layout = image_layout(space)
    if layout is not None:
        sides = space.shape[:2] if layout == "hwc" else space.shape[-2:]
        return "CnnPolicy" if min(sides) >= 36 else "MlpPolicy"
    return "MlpPolicy"


def evaluate(ref: str, act, episodes: int) -> float:
    from opentinker.agents.evaluation import evaluate_episodes

    return evaluate_episodes(ref, act, episodes, EVAL_SEED).mean


def run_sb3(ref: str, budget: int, seed: int, episodes: int) -> dict[str, Any]:
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback

    from opentinker.envs import make_env

    torch.set_num_threads(1)
    started = time.perf_counter()
    env = make_env(ref)
    policy = sb3_policy(env)
    model = PPO(policy, env, seed=seed, device="cpu", verbose=0)
    model.learn(budget)
    train_s = time.perf_counter() - started
    act = lambda obs: model.predict(obs, deterministic=True)[0]  # noqa: E731
    greedy = evaluate(ref, act, episodes)
    result = {"policy": policy, "steps": model.num_timesteps, "train_s": train_s, "greedy": greedy}

    def more(until_s: float) -> dict[str, Any]:
        """Train on until ``until_s`` training seconds (equal time with a slower side), then evaluate."""
        spent = [train_s]

        class Until(BaseCallback):
            def _on_step(self) -> bool:
                return spent[0] + time.perf_counter() - self.t0 < until_s

            def _on_training_start(self) -> None:
                self.t0 = time.perf_counter()

        if until_s > train_s:
            t0 = time.perf_counter()
            model.learn(MAX_TIME_FACTOR * budget, callback=Until(), reset_num_timesteps=False)
            spent[0] += time.perf_counter() - t0
        return {"steps": model.num_timesteps, "train_s": spent[0], "greedy": evaluate(ref, act, episodes)}

    result["more"] = more
    return result


def run_ours(ref: str, budget: int, seed: int, episodes: int, equal_s: float) -> dict[str, Any]:
    from opentinker.agents.evaluation import policy_act
    from opentinker.agents.ppo import PPO
    from opentinker.flows.presets import resolve_spec
    from opentinker.tasks.spec import RunSpec

    started = time.perf_counter()
    spec = resolve_spec(RunSpec(env_id=ref, steps=budget, seed=seed, backend="local"))  # the CLI's resolution
    config = spec.engine.config()
    trainer = PPO(ref, seed=seed, device="cpu", config=config)
    off_clock, at_budget = [0.0], {}

    def greedy_and_sampled() -> tuple[float, float]:
        t0 = time.perf_counter()
        policy = trainer.numpy_policy()
        out = evaluate(ref, policy_act(policy), episodes), evaluate(ref, policy_act(policy, False, seed), episodes)
        off_clock[0] += time.perf_counter() - t0
        return out

    def clock() -> float:
        return time.perf_counter() - started - off_clock[0]

    def callback(metrics: dict, step: int) -> bool:
        if not at_budget and step >= budget:
            at_budget.update(steps=step, train_s=clock())
            at_budget["greedy"], at_budget["sampled"] = greedy_and_sampled()
        return not at_budget or clock() < equal_s

    trainer.train(MAX_TIME_FACTOR * budget, callback=callback)
    equal = {"steps": trainer.global_step, "train_s": clock()}
    equal["greedy"], equal["sampled"] = greedy_and_sampled()
    trainer.env.close()
    fields = ("num_envs", "n_steps", "update_epochs", "num_minibatches", "learning_rate", "anneal_lr")
    return {**at_budget, "equal_time": equal, "config": {k: getattr(config, k) for k in fields}}


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def main() -> None:
    from opentinker.envs.bench_envs import BENCH_ENVS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--budgets", default="20000,100000", help="comma-separated env-step budgets")
    parser.add_argument("--cases", default=",".join(BENCH_ENVS), help=f"comma-separated, of: {', '.join(BENCH_ENVS)}")
    parser.add_argument("--eval-episodes", type=int, default=50)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    budgets = [int(b) for b in args.budgets.split(",")]
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(BENCH_ENVS))
    if unknown:
        parser.error(f"unknown cases {unknown}; expected some of {sorted(BENCH_ENVS)}")

    results: dict[str, Any] = {}
    behind: list[str] = []
    for case in cases:
        cls = BENCH_ENVS[case]
        ref, (low, high) = env_ref(cls), cls.return_range
        for budget in budgets:
            rows = []
            for seed in range(args.seeds):
                sb3 = run_sb3(ref, budget, seed, args.eval_episodes)
                ours = run_ours(ref, budget, seed, args.eval_episodes, sb3["train_s"])
                more = sb3.pop("more")
                sb3["equal_time"] = more(ours["equal_time"]["train_s"])
                rows.append({"seed": seed, "ours": ours, "sb3": sb3})
                print(
                    f"{case} {budget} seed {seed}: ours {ours['greedy']:.2f} (sampled {ours['sampled']:.2f}) in "
                    f"{ours['train_s']:.1f}s, at equal time {ours['equal_time']['greedy']:.2f} "
                    f"({ours['equal_time']['steps']} steps); sb3 {sb3['greedy']:.2f} in {sb3['train_s']:.1f}s "
                    f"({sb3['policy']}), at equal time {sb3['equal_time']['greedy']:.2f}",
                    flush=True,
                )
            summary = {
                "budget": budget,
                "return_range": [low, high],
                "ours_config": rows[0]["ours"]["config"],
                "sb3_policy": rows[0]["sb3"]["policy"],
                "ours_greedy": median([r["ours"]["greedy"] for r in rows]),
                "ours_sampled": median([r["ours"]["sampled"] for r in rows]),
                "ours_train_s": median([r["ours"]["train_s"] for r in rows]),
                "sb3_greedy": median([r["sb3"]["greedy"] for r in rows]),
                "sb3_train_s": median([r["sb3"]["train_s"] for r in rows]),
                "equal_time_s": median([r["sb3"]["train_s"] for r in rows]),
                "ours_equal_time_greedy": median([r["ours"]["equal_time"]["greedy"] for r in rows]),
                "ours_equal_time_steps": median([r["ours"]["equal_time"]["steps"] for r in rows]),
                "sb3_equal_time_greedy": median([r["sb3"]["equal_time"]["greedy"] for r in rows]),
                "per_seed": {side: [round(r[side]["greedy"], 3) for r in rows] for side in ("ours", "sb3")},
            }
            margin = 0.1 * (high - low)
            if summary["ours_greedy"] < summary["sb3_greedy"] - margin:
                behind.append(f"{case}@{budget}")
            if summary["ours_equal_time_greedy"] < summary["sb3_equal_time_greedy"] - margin:
                behind.append(f"{case}@{budget}/time")
            results[f"{case}@{budget}"] = summary

    print(f"\n{'case':32} {'ours':>7} {'sb3':>7} {'ours s':>7} {'sb3 s':>7} {'ours=t':>7} {'sb3=t':>7}")
    for key, s in results.items():
        print(
            f"{key:32} {s['ours_greedy']:7.2f} {s['sb3_greedy']:7.2f} {s['ours_train_s']:7.1f} {s['sb3_train_s']:7.1f} "
            f"{s['ours_equal_time_greedy']:7.2f} {s['sb3_equal_time_greedy']:7.2f}"
        )
    print(json.dumps({"bench": "userenvs", "seeds": args.seeds, "cases": results, "behind": behind}))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
