"""The zoo's cases: env, algorithm, target and budgets per case, and SB3's side of each (RL-Zoo's hyper-parameters,
CleanRL's for Breakout). ``bench/zoo.py`` runs them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Case:
    name: str
    env_id: str
    algorithm: str
    target: float | None
    """Return to reach; None: an equal-wall-time case (returns compared after the same training seconds)."""
    target_source: str
    budget_steps: int
    """SB3's env steps: RL-Zoo's ``n_timesteps`` (where its schedules end), or the issue's budget."""
    eval_every: int
    """Env steps between evaluations, both sides (a multiple of both sides' iteration sizes)."""
    seeds: int
    sb3: dict[str, Any] = field(default_factory=dict)
    sb3_envs: int = 1
    sb3_policy: str = "MlpPolicy"
    eval_kwargs: dict[str, Any] = field(default_factory=dict)
    """Env options for evaluation only (Breakout: an episode cap, so a policy that never serves cannot stall it)."""
    ours_budget: int | None = None
    """Our env steps; None: the run ``opentinker train ENV`` makes (``RunSpec.steps``, its schedules' horizon) when
    longer than ``budget_steps``. The SAC cases give both sides the issue's budget, Breakout ours its own."""


# RL-Zoo hyper-parameters (rl-baselines3-zoo hyperparams/{ppo,dqn,sac}.yml) and reported scores (benchmark.md);
# a ("lin", x) value is a schedule decaying linearly from x to 0.
CASES = {
    "cartpole-ppo": Case(
        "cartpole-ppo",
        "CartPole-v1",
        "ppo",
        475.0,
        "reward_threshold",
        100_000,
        2048,
        5,
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
    ),
    "cartpole-dqn": Case(
        "cartpole-dqn",
        "CartPole-v1",
        "dqn",
        475.0,
        "reward_threshold",
        50_000,
        2048,
        5,
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
    ),
    "mountaincar-dqn": Case(
        "mountaincar-dqn",
        "MountainCar-v0",
        "dqn",
        -110.0,
        "reward_threshold",
        120_000,
        4096,
        5,  # seeds 0-9 (2026-12-05): steps to -110 spread 74k-172k ours, 78k-never SB3; 3 seeds' median is a coin toss
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
    ),
    "pendulum-ppo": Case(
        "pendulum-ppo",
        "Pendulum-v1",
        "ppo",
        -172.225,
        "RL-Zoo score",
        100_000,
        4096,
        5,
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
    ),
    "halfcheetah-sac": Case(
        "halfcheetah-sac",
        "HalfCheetah-v5",
        "sac",
        1500.0,
        "issue 27",
        100_000,
        5000,
        1,
        dict(learning_starts=10_000),
        ours_budget=100_000,
    ),
    "hopper-sac": Case(
        "hopper-sac",
        "Hopper-v5",
        "sac",
        1000.0,
        "issue 27",
        100_000,
        5000,
        1,
        dict(learning_starts=10_000),
        ours_budget=100_000,
    ),
    "breakout-ppo": Case(
        "breakout-ppo",
        "ALE/Breakout-v5",
        "ppo",
        None,
        "equal wall time",
        100_000,
        100_000,
        1,
        dict(  # CleanRL's ppo_atari.py
            n_steps=128,
            batch_size=256,
            n_epochs=4,
            learning_rate=("lin", 2.5e-4),
            clip_range=0.1,
            gamma=0.99,
            gae_lambda=0.95,
            ent_coef=0.01,
            vf_coef=0.5,
            max_grad_norm=0.5,
        ),
        8,
        "CnnPolicy",
        dict(max_episode_steps=4_500),  # 5 minutes of play (18,000 frames)
        ours_budget=100_000,
    ),
}
