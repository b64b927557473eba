"""The one run spec: every algorithm's spec crosses a process boundary as JSON and comes back equal, resolution
happens once, bad input is one line naming the field, and the SDK trains with the preset the CLI picks."""

from __future__ import annotations

import dataclasses

import pytest

from opentinker.agents.config import CONFIGS, DQNConfig, GRPOConfig, PPOConfig
from opentinker.flows.params import ConfigError, load_spec
from opentinker.flows.presets import resolve_spec
from opentinker.tasks.spec import MEMBERS, RunSpec

SPECS = {
    "ppo": dict(env_id="Pendulum-v1", steps=4096, ppo={"hidden_sizes": (32, 32), "norm_obs": True}),
    "dqn": dict(env_id="CartPole-v1", algorithm="dqn", num_envs=2, dqn={"epsilon_decay": 0.99}),
    "sac": dict(env_id="Pendulum-v1", algorithm="sac", num_envs=1, sac={"learning_starts": 100, "alpha": 0.2}),
    "td3": dict(env_id="Pendulum-v1", algorithm="td3", td3={"policy_delay": 3}),
    "grpo": dict(env_id="arithmetic", algorithm="grpo", updates=3, backend="local", grpo={"base_model": "tiny"}),
    "group": dict(policy_mapping={"predator": "PPO", "prey": "DQN"}, configs={"prey": {"lr": 1e-3}}, steps=64),
}


def test_every_algorithm_has_a_spec():
    assert set(MEMBERS) == {*CONFIGS, "grpo", "group"} and set(SPECS) == set(MEMBERS)


@pytest.mark.parametrize("algorithm", sorted(SPECS))
def test_a_spec_round_trips_through_json_and_the_config_form_exactly(algorithm):
    spec = RunSpec(**SPECS[algorithm])
    assert spec.algorithm == algorithm
    for each in (spec, resolve_spec(spec)):
        assert RunSpec.model_validate_json(each.model_dump_json()) == each  # a process boundary
        assert RunSpec.model_validate(each.model_dump(mode="json")) == each  # a Prefect deployment's parameters
        assert RunSpec.model_validate(each.config_form()) == each  # a config file
    assert resolve_spec(spec) != spec  # resolved is part of what the run is


@pytest.mark.parametrize("algorithm", sorted(SPECS))
def test_resolution_happens_once(algorithm):
    resolved = resolve_spec(RunSpec(**SPECS[algorithm]))
    assert resolved.resolved and resolve_spec(resolved) is resolved  # not resolved again
    arrived = RunSpec.model_validate_json(resolved.model_dump_json())  # e.g. from a deployment or a job record
    assert resolve_spec(arrived) is arrived


def test_resolution_fills_the_preset_under_the_users_fields_and_keeps_the_config_typed():
    resolved = resolve_spec(RunSpec(**SPECS["ppo"]))
    config = resolved.engine.config()
    assert isinstance(config, PPOConfig) and config.hidden_sizes == (32, 32) and config.norm_obs  # the user's
    assert config.gamma == 0.9 and config.num_envs == 16 and resolved.engine.backend == "local"  # Pendulum's preset
    assert resolved.champion_threshold is None  # Pendulum has no reward threshold
    assert isinstance(resolve_spec(RunSpec(**SPECS["dqn"])).engine.config(), DQNConfig)
    grpo = resolve_spec(RunSpec(**SPECS["grpo"]))
    assert grpo.engine.config(task=grpo.env_id) == GRPOConfig(task="arithmetic", base_model="tiny")
    assert grpo.champion_threshold == 0.0 and grpo.budget == 3 and grpo.steps is None


def test_grpo_counts_updates_and_reads_steps_as_their_old_name():
    old = load_spec(None, env_id="arithmetic", algorithm="grpo", steps=7)
    assert old.engine.updates == 7 and old.budget == 7 and old.steps is None
    assert old == load_spec(None, env_id="arithmetic", algorithm="grpo", updates=7)
    assert RunSpec(task="tool_arithmetic", algorithm="grpo").env_id == "tool_arithmetic"  # its old field name


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (dict(algorithm="dqn", ppo={"clip_coef": 0.1}), "ppo: does not apply to algorithm 'dqn'"),
        (dict(dqn={"gae_lambda": 0.9}, algorithm="dqn"), "'gae_lambda' does not apply to algorithm 'dqn'"),
        (dict(algorithm="grpo", grpo={"n_steps": 8}), "'n_steps' does not apply to algorithm 'grpo'"),
        (dict(algorithm="grpo", num_gpus=1.0), "num_gpus: does not apply to algorithm 'grpo'"),
        (dict(algorithm="ppo", updates=5), "updates: counts GRPO's optimiser updates"),
        (dict(algorithm="grpo", env_id="nope"), "env_id: unknown text task 'nope'"),
        (dict(algorithm="grpo", steps=2, updates=3), "steps"),
        (dict(algorithm="sarsa"), "algorithm: expected one of 'ppo', 'dqn'"),
        (dict(policy_mapping={"a": "A3C"}), "policy_mapping['a']"),
    ],
)
def test_bad_input_is_one_line_naming_the_field(overrides, expected):
    with pytest.raises(ConfigError) as raised:
        load_spec(None, **overrides)
    message = str(raised.value)
    assert "\n" not in message and expected in message, message


def test_the_sdk_trains_with_the_clis_preset_and_keyword_arguments_override_it():
    from opentinker import DQNTrainer, PPOTrainer

    cli = resolve_spec(RunSpec(env_id="Pendulum-v1")).engine.config()
    trainer = PPOTrainer("Pendulum-v1")
    try:
        assert trainer.config == cli and trainer.config.gamma == 0.9 and trainer.config.reward_scale == 0.1
    finally:
        trainer.env.close()
    trainer = PPOTrainer("Pendulum-v1", gamma=0.95, num_envs=2)
    try:
        assert trainer.config == dataclasses.replace(cli, gamma=0.95, num_envs=2) and trainer.env.num_envs == 2
    finally:
        trainer.env.close()
    trainer = DQNTrainer("CartPole-v1", learning_starts=10)
    try:
        expected = resolve_spec(RunSpec(algorithm="dqn", dqn={"learning_starts": 10})).engine.config()
        assert trainer.config == expected and trainer.config.hidden_sizes == (256, 256)
    finally:
        trainer.env.close()
