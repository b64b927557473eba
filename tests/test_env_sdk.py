"""Env SDK contract: BaseEnv space checks, make_env errors, validate_env reports, RemoteEnv local API."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from opentinker.envs import BaseEnv, EnvSpecError, EnvValidationError, RemoteEnv, make_env, validate_env


class GoodEnv(BaseEnv):
    """A 1-D walk: move left/right, episode ends at +-3 or after 20 steps."""

    def __init__(self, limit: int = 3):
        self.observation_space = gym.spaces.Box(-10.0, 10.0, (1,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.limit, self.pos, self.t = limit, 0, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos, self.t = int(self.np_random.integers(-1, 2)), 0
        return np.array([self.pos], np.float32), {}

    def step(self, action):
        self.pos += 1 if action == 1 else -1
        self.t += 1
        terminated = abs(self.pos) >= self.limit
        return np.array([self.pos], np.float32), float(terminated), terminated, self.t >= 20, {}


class NoSpaces(BaseEnv):
    def __init__(self):
        self.action_space = gym.spaces.Discrete(2)


class WrongSpace(BaseEnv):
    def __init__(self):
        self.observation_space = (0, 1)
        self.action_space = gym.spaces.Discrete(2)


class BrokenEnv(GoodEnv):
    """Defects validate_env must name: float64 obs for a float32 space, obs out of bounds, a str reward,
    an int terminated flag."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.array([self.pos], np.float64), {}

    def step(self, action):
        obs, _reward, terminated, truncated, info = super().step(action)
        return obs * 100 + np.random.random(), "1", int(terminated), truncated, info


def test_base_env_names_class_and_missing_field():
    with pytest.raises(EnvSpecError, match=r"NoSpaces\.observation_space is missing"):
        NoSpaces()
    with pytest.raises(
        EnvSpecError, match=r"WrongSpace\.observation_space must be a gymnasium\.spaces\.Space, got tuple"
    ):
        WrongSpace()
    assert GoodEnv().observation_space.shape == (1,)


def test_base_env_check_runs_after_subclass_init():
    class Sub(GoodEnv):
        def __init__(self):
            super().__init__(limit=4)  # the parent's __init__ must not check before this one finishes
            self.extra = True

    assert Sub().limit == 4


def test_make_env_accepts_ids_classes_factories_and_rejects_unknown():
    assert make_env("CartPole-v1").spec.id == "CartPole-v1"
    assert isinstance(make_env(GoodEnv, limit=5), GoodEnv)
    assert make_env(lambda: GoodEnv()).limit == 3
    with pytest.raises(EnvSpecError, match="'NoSuchEnv-v0' is not a registered gymnasium env"):
        make_env("NoSuchEnv-v0")
    with pytest.raises(EnvSpecError, match="Did you mean: `CartPole`"):  # gymnasium's hint is passed on
        make_env("Cartpole-v1")
    with pytest.raises(EnvSpecError, match=r"returned int, expected a gymnasium\.Env"):
        make_env(lambda: 3)


def test_validate_env_passes_good_envs():
    validate_env(GoodEnv())
    validate_env("CartPole-v1")
    validate_env("Pendulum-v1")


def test_validate_env_lists_every_problem_of_a_broken_env():
    with pytest.raises(EnvValidationError) as info:
        validate_env(BrokenEnv())
    report = "\n".join(info.value.problems)
    assert "dtype float64 differs from observation_space dtype float32" in report
    assert "is outside observation_space" in report
    assert "reward is str, expected a float" in report
    assert "terminated is int, expected bool" in report
    assert "gymnasium check_env" in report
    assert str(info.value).startswith("BrokenEnv failed validation with")


def test_validate_env_catches_nondeterminism():
    class Noisy(GoodEnv):
        def step(self, action):
            obs, *rest = super().step(action)
            return np.clip(obs + np.float32(np.random.random() * 0.1), -10, 10).astype(np.float32), *rest

    with pytest.raises(EnvValidationError, match="not deterministic"):
        validate_env(Noisy())


def test_remote_env_validates_before_the_job_starts():
    with pytest.raises(EnvValidationError):
        RemoteEnv(BrokenEnv, parallel=2, backend="local")


def test_remote_env_rejects_bad_arguments():
    with pytest.raises(EnvSpecError, match="parallel must be an int >= 1"):
        RemoteEnv("CartPole-v1", parallel=0)
    with pytest.raises(EnvSpecError, match=r"workers must be an int in \[1, parallel=2\]"):
        RemoteEnv("CartPole-v1", parallel=2, workers=3)
    with pytest.raises(EnvSpecError, match="backend must be one of"):
        RemoteEnv("CartPole-v1", backend="threads")


def test_remote_env_vector_api_is_numpy_and_autoresets():
    env = RemoteEnv(GoodEnv, parallel=3, workers=2, backend="local")
    assert (env.num_envs, env.num_workers, env.env_id) == (3, 2, "GoodEnv")
    obs, _ = env.reset(seed=1)
    assert obs.shape == (3, 1) and obs.dtype == np.float32
    done_seen = False
    for _ in range(8):  # always right: every copy reaches +3 within 4 steps, then resets on the next step
        obs, reward, terminated, _truncated, _ = env.step(np.ones(3, np.int64))
        assert isinstance(reward, np.ndarray) and reward.shape == (3,)
        done_seen |= bool(terminated.any())
    assert done_seen and np.all(np.abs(obs) <= 3)
    obs_again, _ = env.reset(seed=1)
    assert np.array_equal(env.reset(seed=1)[0], obs_again)


def test_auto_backend_stays_local_for_vectorised_and_small_envs():
    assert RemoteEnv("CartPole-v1", parallel=64).backend == "local"
    assert RemoteEnv(GoodEnv, parallel=4).backend == "local"
