"""Env families out of the box: MuJoCo and Atari ids build through ``make_env`` (Atari preprocessed and frame-stacked
by default), and the presets recognise each family from the env itself."""

from __future__ import annotations

import numpy as np
import pytest

from opentinker.envs import RemoteEnv, make_env
from opentinker.flows.presets import engine_preset, problem_kind


def test_atari_ids_are_preprocessed_and_stacked():
    env = make_env("ALE/Breakout-v5")
    first, _ = env.reset(seed=0)
    assert first.shape == (4, 84, 84) and first.dtype == np.uint8 and env.observation_space.shape == (4, 84, 84)
    second, *_ = env.step(1)  # FIRE
    assert np.array_equal(second[:3], first[1:])  # the stack shifts by one 84x84 grayscale frame per action
    env.close()
    raw = make_env("ALE/Breakout-v5", preprocess=False)
    assert raw.observation_space.shape == (210, 160, 3)
    raw.close()
    single = make_env("ALE/Breakout-v5", frame_stack=1)
    assert single.observation_space.shape == (84, 84)
    single.close()


def test_atari_copies_step_in_the_same_format():
    with RemoteEnv("ALE/Breakout-v5", parallel=2, backend="local") as env:
        assert env.single_observation_space.shape == (4, 84, 84)
        obs, *_ = env.step(np.array([1, 0]))
        assert obs.shape == (2, 4, 84, 84) and obs.dtype == np.uint8


@pytest.mark.parametrize("env_id, obs_dim, act_dim", [("HalfCheetah-v5", 17, 6), ("Hopper-v5", 11, 3)])
def test_mujoco_envs_build_and_step(env_id, obs_dim, act_dim, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = make_env(env_id)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (obs_dim,) and env.action_space.shape == (act_dim,)
    obs, reward, terminated, _, _ = env.step(np.zeros(act_dim, np.float32))
    assert np.all(np.isfinite(obs)) and np.isfinite(reward) and not terminated
    env.close()
    assert not (tmp_path / "MUJOCO_LOG.TXT").exists()  # MuJoCo's warnings go to logging (envs/mujoco_log.py)


def test_presets_know_each_family_from_the_env():
    assert problem_kind("HalfCheetah-v5").suite == "mujoco" and problem_kind("Pendulum-v1").suite is None
    assert problem_kind("ALE/Breakout-v5").suite == "atari"
    assert engine_preset("sac", "Walker2d-v5")["learning_starts"] == 10_000  # RL-Zoo's MuJoCo SAC
    assert "learning_rate" not in engine_preset("sac", "Walker2d-v5")  # SACConfig's 3e-4
    for env_id in ("Hopper-v5", "HalfCheetah-v5"):  # per id: the family's SAC at lr 1e-3
        assert engine_preset("sac", env_id) == {"num_envs": 1, "learning_starts": 10_000, "learning_rate": 1e-3}
    assert engine_preset("td3", "HalfCheetah-v5")["hidden_sizes"] == (400, 300)
    assert engine_preset("ppo", "HalfCheetah-v5")["norm_obs"] is True  # PPO: the continuous family's preset
    assert engine_preset("ppo", "ALE/Breakout-v5")["clip_coef"] == 0.1  # CleanRL's ppo_atari
    assert engine_preset("sac", "Pendulum-v1")["learning_starts"] == 1_000
    with pytest.raises(ValueError, match=r"algorithm: 'dqn' does not handle the atari family .*; use ppo$"):
        engine_preset("dqn", "ALE/Breakout-v5")
    with pytest.raises(ValueError, match=r"algorithm: 'sac' does not handle discrete actions .*; use dqn or ppo$"):
        engine_preset("sac", "CartPole-v1")
