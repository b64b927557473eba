"""CLI errors for the pipeline commands: clear message naming the field, exit code 1, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from opentinker.cli import app

runner = CliRunner()


def _fails_cleanly(args: list[str], *expected: str) -> str:
    result = runner.invoke(app, args)
    output = result.output
    assert result.exit_code == 1, output
    assert "Traceback" not in output
    for text in expected:
        assert text in output, output
    return output


def test_bad_env_id_names_the_field_and_the_id():
    _fails_cleanly(["train", "NoSuchEnv-v9", "--steps", "1000"], "env_id", "NoSuchEnv-v9")


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('steps = "many"', ["steps", "valid integer", "'many'"]),
        ("steps = -5", ["steps", "greater than 0"]),
        ("stepz = 100", ["stepz", "unknown field", "did you mean 'steps'?"]),
        ("learning_rate = 0.1", ["learning_rate: unknown field", "it is a ppo setting: ppo.learning_rate"]),
        ('algorithm = "dqn"\nbufer_size = 9', ["bufer_size: unknown field", "did you mean 'dqn.buffer_size'?"]),
        ('algorithm = "grpo"\ngroup_sise = 4', ["group_sise: unknown field", "did you mean 'grpo.group_size'?"]),
        ("[ppo]\nlearning_rat = 0.1", ["ppo", "unknown PPOConfig field 'learning_rat'", "learning_rate"]),
        ("[ppo]\ngamma = 3.0", ["ppo", "gamma", "[0, 1]"]),
        ("steps = [", ["not valid TOML"]),
    ],
)
def test_bad_config_file_names_the_field(tmp_path, body, expected):
    config = tmp_path / "train.toml"
    config.write_text(body + "\n")
    _fails_cleanly(["train", "CartPole-v1", "--config", str(config)], *expected)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            'policy_mapping = {predator = "PPO", prey = "A3C"}',
            ["multi-agent", "policy_mapping['prey']", "'A3C'", "['DQN', 'PPO']"],
        ),
        ('policy_mapping = {predator = "PPO"}\n[configs.prey]\nlr = 0.1', ["unknown kind 'prey'", "['predator']"]),
        ('policy_mapping = {predator = "PPO", prey = "DQN"}\nstepz = 3', ["multi-agent", "stepz", "unknown field"]),
    ],
)
def test_bad_multiagent_config_names_the_field(tmp_path, body, expected):
    config = tmp_path / "hunt.toml"
    config.write_text(body + "\n")
    _fails_cleanly(["train", "pursuit", "--config", str(config)], *expected)


def test_a_policy_mapping_makes_train_run_the_group_flow(tmp_path):
    from opentinker.flows.params import load_spec

    config = tmp_path / "hunt.toml"
    config.write_text('policy_mapping = {predator = "PPO", prey = "DQN"}\n[configs.prey]\nepsilon_decay = 0.99\n')
    params = load_spec(config, env_id="pursuit", steps=512)
    assert (
        params.algorithm == "group" and params.steps == 512 and params.engine.configs["prey"]["epsilon_decay"] == 0.99
    )
    assert load_spec(None, env_id="CartPole-v1").algorithm == "ppo"
    # Deployments run the single-agent train_flow: a group config is refused, not silently misread.
    _fails_cleanly(
        ["schedule", "pursuit", "--config", str(config), "--cron", "0 3 * * *"], "policy_mapping", "opentinker train"
    )


def test_missing_config_file_and_bad_cron(tmp_path):
    _fails_cleanly(["train", "CartPole-v1", "--config", str(tmp_path / "nope.toml")], "does not exist")
    _fails_cleanly(["schedule", "CartPole-v1", "--cron", "every night"], "cron", "every night")


def test_schedule_without_a_prefect_server_says_how_to_get_one(monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("OPENTINKER_PREFECT_API_URL", raising=False)
    from opentinker.infra.settings import get_settings

    get_settings.cache_clear()
    try:
        _fails_cleanly(["schedule", "CartPole-v1", "--cron", "0 3 * * *"], "prefect_api_url", "opentinker stack up")
    finally:
        get_settings.cache_clear()


def test_real_process_exit_code_and_no_traceback(tmp_path):
    """The installed entry point, as a user runs it: non-zero exit, one clear line, no traceback."""
    exe = Path(sys.executable).with_name("opentinker")
    config = tmp_path / "bad.json"
    config.write_text('{"env_id": "CartPole-v1", "eval_episodes": 0}')
    done = subprocess.run(
        [str(exe), "train", "CartPole-v1", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "eval_episodes" in output and "greater than 0" in output
    assert "Traceback" not in output


@pytest.mark.parametrize(
    ("body", "algorithm", "expected"),
    [
        ('algorithm = "dqn"\nnum_envs = 4\n[dqn]\nbatch_size = 64\nhidden_sizes = [32, 32]\n', "dqn", {}),
        ("num_envs = 4\n[dqn]\nbatch_size = 64\nhidden_sizes = [32, 32]\n", "dqn", {}),  # as with --algo dqn
        ('[engine]\nalgorithm = "ppo"\nnum_envs = 4\nn_steps = 64\nhidden_sizes = [32, 32]\n', None, {"n_steps": 64}),
    ],
)
def test_config_file_parses_into_the_algorithms_typed_engine_config(tmp_path, body, algorithm, expected):
    """The [ppo]/[dqn] table form and the [engine] form both give the algorithm's union member; the params read
    back in the config file's form and survive Prefect's JSON round trip."""
    from opentinker.agents.config import CONFIGS
    from opentinker.flows.params import TrainParams, load_spec

    config = tmp_path / "train.toml"
    config.write_text(body)
    params = load_spec(config, env_id="CartPole-v1", algorithm=algorithm)
    engine = params.engine
    assert engine.config_cls is CONFIGS[engine.algorithm] and engine.num_envs == 4
    assert engine.hidden_sizes == (32, 32) and all(getattr(engine, k) == v for k, v in expected.items())
    if engine.algorithm == "dqn":
        assert engine.batch_size == 64 and params.config_form()["dqn"]["batch_size"] == 64
    form = params.config_form()
    assert form["algorithm"] == engine.algorithm and form["num_envs"] == 4 and "engine" not in form
    assert TrainParams.model_validate(form) == params
    assert TrainParams.model_validate_json(params.model_dump_json()) == params


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("[ppo]\nbatch_size = 64", ["ppo", "'batch_size' does not apply to algorithm 'ppo'", "DQNConfig"]),
        ('algorithm = "dqn"\n[dqn]\nclip_coef = 0.1', ["dqn", "'clip_coef' does not apply to algorithm 'dqn'"]),
        ('[engine]\nalgorithm = "dqn"\ngae_lambda = 0.9', ["'gae_lambda' does not apply to algorithm 'dqn'"]),
    ],
)
def test_a_field_of_another_algorithm_is_an_error_naming_field_and_algorithm(tmp_path, body, expected):
    config = tmp_path / "train.toml"
    config.write_text(body + "\n")
    _fails_cleanly(["train", "CartPole-v1", "--config", str(config)], *expected)


def test_the_engine_trainer_refuses_another_algorithms_field_and_keeps_its_env_copies():
    from opentinker.agents import DQN, PPO
    from opentinker.envs import RemoteEnv

    with pytest.raises(ValueError, match="'epsilon_decay' does not apply to algorithm 'ppo'"):
        PPO("CartPole-v1", epsilon_decay=0.99)
    with RemoteEnv("CartPole-v1", parallel=3, backend="local") as env:
        assert DQN(env, learning_starts=10).config.num_envs == 3  # built with it, never overwritten
