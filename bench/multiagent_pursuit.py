"""50-agent pursuit: agent-steps/s of group training and wall time until predators reach a capture rate.

Measured in one command:
  1. reference: the raw env stepped with uniformly random actions (PettingZoo dict API), agent-steps/s and the
     capture rate random predators achieve against random prey;
  2. the group (predators PPO, prey DQN, trained together) until the capture rate, pooled over the prey
     episodes of the last ``--window`` iterations, reaches ``--threshold`` (default 0.9; random predators reach
     ~0.62) or the budget ends.

Capture rate = share of prey episodes that end in a capture (``prey/charts/terminated_fraction``).
Final line: ``{"agents": 50, "agent_steps_per_s": …, "time_to_threshold_s": …, …}``.

    .venv/bin/python bench/multiagent_pursuit.py [--budget-s 300] [--threshold 0.95] [--backend ray --workers 2]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from opentinker.agents.multiagent import AgentGroup
from opentinker.envs.pursuit import PursuitEnv

SEED_CLAIM_S = 1.5 * 3600  # the seed's "50-agent hunt trained in 1.5 h" (down from 8 h)


def random_reference(env_kwargs: dict, seconds: float, seed: int = 0) -> tuple[float, float]:
    """(agent-steps/s, capture rate) of the bare env with random actions for every agent."""
    env = PursuitEnv(**env_kwargs)
    rng = np.random.default_rng(seed)
    env.reset(seed=seed)
    steps, caught, prey_episodes = 0, 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        actions = dict(zip(env.agents, rng.integers(0, 5, size=len(env.agents)).tolist()))
        _, _, term, trunc, _ = env.step(actions)
        steps += len(actions)
        for agent in env.prey:
            if agent in term and (term[agent] or trunc[agent]):
                prey_episodes += 1
                caught += term[agent]
        if not env.agents:
            env.reset()
    return steps / (time.perf_counter() - start), caught / max(prey_episodes, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--predators", type=int, default=25)
    parser.add_argument("--prey", type=int, default=25)
    parser.add_argument("--grid", type=int, default=24)
    parser.add_argument("--max-cycles", type=int, default=40)
    parser.add_argument("--num-envs", type=int, default=2)
    parser.add_argument("--n-steps", type=int, default=32)
    parser.add_argument("--threshold", type=float, default=0.9, help="capture rate to reach (random predators: ~0.62)")
    parser.add_argument("--window", type=int, default=5, help="iterations pooled for the capture rate")
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--reference-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--backend",
        choices=("local", "ray", "auto"),
        default="local",
        help="where the env copies run (ray: split over --workers actors; same rollouts)",
    )
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    env_kwargs = dict(
        n_predators=args.predators, n_prey=args.prey, grid_size=args.grid, max_cycles=args.max_cycles, capture_radius=0
    )
    agents = args.predators + args.prey

    ref_sps, random_capture = random_reference(env_kwargs, args.reference_s, args.seed)
    threshold = args.threshold
    print(
        f"reference (random actions): {ref_sps:,.0f} agent-steps/s, capture rate {random_capture:.3f}; "
        f"threshold {threshold:.3f}"
    )

    group = AgentGroup({"predator": "PPO", "prey": "DQN"}).configure(
        predator={"lr": 3e-3, "gamma": 0.95, "update_epochs": 8, "num_minibatches": 4, "ent_coef": 0.003},
        prey={
            "lr": 1e-3,
            "gamma": 0.95,
            "learning_starts": 2_000,
            "train_frequency": 32,
            "batch_size": 128,
            "buffer_size": 50_000,
            "target_network_frequency": 2_000,
            "epsilon_decay": 0.97 ** (1 / args.n_steps),
        },
    )  # 0.97 per iteration, as a per-step factor
    trainer = group.build(
        "pursuit",
        num_envs=args.num_envs,
        n_steps=args.n_steps,
        seed=args.seed,
        device="cpu",
        backend=args.backend,
        workers=args.workers,
        **env_kwargs,
    )
    # (prey episodes, caught) per iteration; early iterations are skipped because before the first time limit
    # only episodes that ended in a capture can have ended, which would overstate the rate.
    counts: list[tuple[float, float]] = []
    warmup_steps = 2 * args.max_cycles * args.num_envs
    reached: dict[str, float] = {}
    start = time.perf_counter()
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
    )

    def capture_rate() -> float:
        episodes, caught = np.sum(counts[-args.window :], axis=0) if counts else (0.0, 0.0)
        return caught / episodes if episodes else float("nan")

    with Progress(*columns) as progress:
        task = progress.add_task("training 50-agent pursuit", total=args.budget_s, status="")

        def on_iteration(metrics: dict[str, float], step: int) -> bool:
            elapsed = time.perf_counter() - start
            if step > warmup_steps and "prey/charts/terminated_fraction" in metrics:
                episodes = metrics["prey/charts/episodes"]
                counts.append((episodes, episodes * metrics["prey/charts/terminated_fraction"]))
            rate = capture_rate()
            progress.update(
                task, completed=min(elapsed, args.budget_s), status=f"step {step:,}  capture {rate:.3f}/{threshold:.3f}"
            )
            if len(counts) >= args.window and rate >= threshold and not reached:
                reached.update(time_s=elapsed, env_steps=step, capture_rate=rate)
                return False
            return elapsed < args.budget_s

        trainer.train(10**9, callback=on_iteration)
    wall = time.perf_counter() - start
    trainer.close()
    train_sps = trainer.agent_steps / wall
    time_to_threshold = reached.get("time_s")
    print(
        json.dumps(
            {
                "agents": agents,
                "backend": trainer.backend,
                "workers": trainer.workers,
                "agent_steps_per_s": round(train_sps, 1),
                "time_to_threshold_s": None if time_to_threshold is None else round(time_to_threshold, 1),
                "threshold_capture_rate": round(threshold, 3),
                "random_capture_rate": round(random_capture, 3),
                "final_capture_rate": round(capture_rate(), 3) if counts else None,
                "env_steps": trainer.global_step,
                "wall_s": round(wall, 1),
                "reference_random_agent_steps_per_s": round(ref_sps, 1),
                "train_vs_random_env_ratio": round(train_sps / ref_sps, 3),
                "speedup_vs_seed_claim_1_5h": None
                if time_to_threshold is None
                else round(SEED_CLAIM_S / time_to_threshold, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
