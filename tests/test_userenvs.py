"""A user's own env: defaults that follow the step budget (``presets.budget_defaults``), and the shipped bench envs
(``opentinker.envs.bench_envs``) learn under them."""

from __future__ import annotations

import numpy as np
import pytest

from opentinker.envs.bench_envs import BENCH_ENVS
from opentinker.flows.presets import FAMILIES, problem_kind, resolve_spec
from opentinker.tasks.spec import RunSpec

GRID = "opentinker.envs.bench_envs:GridReachEnv"
SCHEDULE = ("num_envs", "n_steps", "update_epochs", "num_minibatches", "learning_rate", "anneal_lr")


def resolved(env_id: str, steps: int, **fields):
    return resolve_spec(RunSpec(env_id=env_id, steps=steps, **fields)).engine


def test_a_small_and_a_large_budget_resolve_to_different_settings():
    small, large = resolved(GRID, 20_000), resolved(GRID, 2_000_000)
    assert problem_kind(GRID).episode_steps == 20 and not problem_kind(GRID).registered
    assert small.num_envs * small.n_steps == 512 and small.update_epochs == 10 and small.anneal_lr is False
    assert (small.num_envs, small.n_steps) == (8, 64)  # 20-step episodes: 64 steps a copy
    assert {k: getattr(large, k) for k in ("num_envs", "n_steps", "learning_rate")} == {
        k: FAMILIES[("ppo", "discrete")][k] for k in ("num_envs", "n_steps", "learning_rate")
    }
    assert [getattr(small, k) for k in SCHEDULE] != [getattr(large, k) for k in SCHEDULE]
    assert resolved(GRID, 1, ppo={"total_steps": 2_000_000}).num_envs == large.num_envs  # the horizon is a budget


def test_explicit_config_wins_over_the_budget_table():
    engine = resolved(GRID, 20_000, num_envs=3, ppo={"update_epochs": 2, "anneal_lr": True, "learning_rate": 1e-3})
    assert (engine.num_envs, engine.update_epochs, engine.anneal_lr, engine.learning_rate) == (3, 2, True, 1e-3)
    assert engine.n_steps == 64  # what was not set still comes from the table


def test_the_sdk_trains_with_what_the_cli_resolves_for_the_budget_it_is_given():
    """``PPOTrainer(env_id)`` learns the budget only at ``train(steps)``: it then has the settings of ``opentinker
    train ENV --steps N`` (``checked_spec``), and a keyword argument given at construction still wins."""
    from opentinker import PPOTrainer
    from opentinker.flows.validate import checked_spec

    cli = checked_spec(GRID, None, steps=20_000).engine.config()
    trainer = PPOTrainer(GRID)
    try:
        assert trainer.config != cli  # no budget yet: the family's preset
        trainer.train(steps=20_000)
        assert trainer.config == cli and trainer.env.num_envs == cli.num_envs and trainer.global_step >= 20_000
    finally:
        trainer.env.close()
    explicit = PPOTrainer(GRID, num_envs=4, update_epochs=2)
    try:
        explicit.train(steps=1024)
        assert (
            explicit.config
            == checked_spec(GRID, None, steps=1024, num_envs=4, ppo={"update_epochs": 2}).engine.config()
        )
        assert (explicit.config.num_envs, explicit.config.update_epochs, explicit.config.n_steps) == (4, 2, 64)
    finally:
        explicit.env.close()


def test_registered_envs_keep_their_family_preset_at_every_budget():
    assert resolved("CartPole-v1", 20_000) == resolved("CartPole-v1", 2_000_000)


def test_episode_length_sizes_the_rollout():
    catch = resolved("opentinker.envs.bench_envs:CatchEnv", 100_000)  # 15-step episodes, a 2,048 batch
    assert (catch.num_envs, catch.n_steps) == (32, 64)
    box = resolved("opentinker.envs.bench_envs:PointReachEnv", 20_000)
    assert box.norm_obs and box.num_envs * box.n_steps == 512  # the continuous family's observation normalisation
    assert box.norm_reward is False and resolved("opentinker.envs.bench_envs:PointReachEnv", 100_000).norm_reward


LEARNS = {
    # case: (env steps, greedy return it must reach): about a third of the way from random to the best or more
    "vector-discrete": (10_000, 0.3),
    "dict-discrete": (20_000, -0.2),
    "image16-discrete": (20_000, 0.0),
    "vector-multibinary": (10_000, 0.8),
    "vector-box": (10_000, 0.8),
}
"""The large-image case (``image64-discrete``) is the same game as ``image16-discrete``: left to the benchmark."""


def train_bench_env(case: str, steps: int):
    """The in-process trainer with the CLI's resolution (``opentinker train ENV --steps N``), trained."""
    from opentinker.agents.ppo import PPO

    cls = BENCH_ENVS[case]
    env_id = f"{cls.__module__}:{cls.__name__}"
    trainer = PPO(env_id, seed=0, device="cpu", config=resolved(env_id, steps, backend="local").config())
    trainer.train(steps)
    return trainer


@pytest.mark.parametrize("case", sorted(LEARNS))
def test_each_bench_env_learns_in_seconds_under_the_defaults(case):
    steps, target = LEARNS[case]
    low, high = BENCH_ENVS[case].return_range
    assert low < target < high
    trainer = train_bench_env(case, steps)
    try:
        result = trainer.evaluate(episodes=20)
    finally:
        trainer.env.close()
    assert result.mean >= target, (case, result.mean, np.round(result.returns, 2))


def test_key_door_learns_to_open_the_door_and_evaluation_says_greedy_lags():
    """The MultiDiscrete case (``[move, use]``): after 20k steps the sampled policy opens the door in most episodes;
    its greedy action, the mode of each dimension, does less often ("use" is not yet above 1/2 on every key cell):
    both figures are reported, as the bench does."""
    trainer = train_bench_env("vector-multidiscrete", 20_000)
    try:
        greedy, sampled = trainer.evaluate(episodes=30), trainer.evaluate(episodes=30, deterministic=False)
    finally:
        trainer.env.close()
    assert sampled.mean >= 0.15 and greedy.mean > -0.15, (greedy.mean, sampled.mean)
