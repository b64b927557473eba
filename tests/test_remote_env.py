"""RemoteEnv on real Ray actors: same data as the local backend, exact recovery from a killed worker,
validation on the worker, and @remote tasks with priorities."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from opentinker.agents import PPO
from opentinker.agents.policies import ActorCritic, policy_spec
from opentinker.envs import EnvValidationError, RemoteEnv, remote

ENV = "Acrobot-v1"  # no numpy-vectorised implementation: a SyncVectorEnv inside each worker


def policy_for(env: RemoteEnv):
    spec = policy_spec(env.single_observation_space, env.single_action_space, False, (16, 16), "tanh")
    torch.manual_seed(0)
    return ActorCritic(spec).numpy_weights(), spec


def assert_same_rollout(a, b):
    for field in ("obs", "actions", "logprobs", "values", "rewards", "terminated", "truncated", "valid", "last_obs"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
    np.testing.assert_array_equal(a.episode_returns, b.episode_returns)


@pytest.fixture(scope="module")
def envs(ray_session):
    local = RemoteEnv(ENV, parallel=4, workers=2, backend="local", seed=3)
    on_ray = RemoteEnv(ENV, parallel=4, workers=2, backend="ray", seed=3, state_diff=True)
    yield local, on_ray
    on_ray.close()


def test_ray_collect_equals_local_collect(envs):
    local, on_ray = envs
    assert on_ray.backend == "ray" and len(set(on_ray.worker_pids())) == 2 and os.getpid() not in on_ray.worker_pids()
    weights, spec = policy_for(local)
    for iteration in range(2):
        a, b = local.collect(weights, spec, 40, iteration), on_ray.collect(weights, spec, 40, iteration)
        assert_same_rollout(a, b)
        assert isinstance(b.obs, np.ndarray) and b.obs.shape == (40, 4, 6)
        assert b.bytes_sent < b.bytes_raw  # observations travelled delta-encoded


def test_killed_worker_is_replaced_and_its_collect_reproduced(envs):
    local, on_ray = envs
    weights, spec = policy_for(local)
    for iteration in range(2, 4):  # keep both envs on the same iteration sequence as the test above
        local.collect(weights, spec, 40, iteration), on_ray.collect(weights, spec, 40, iteration)
    victim = on_ray.worker_pids()[1]
    os.kill(victim, signal.SIGKILL)  # between iterations
    assert_same_rollout(local.collect(weights, spec, 40, 4), on_ray.collect(weights, spec, 40, 4))
    victim = on_ray.worker_pids()[0]
    killer = threading.Timer(0.2, os.kill, (victim, signal.SIGKILL))  # and in the middle of a long collect
    killer.start()
    expected = local.collect(weights, spec, 3000, 5)
    got = on_ray.collect(weights, spec, 3000, 5)
    killer.join()
    assert_same_rollout(expected, got)
    assert victim not in on_ray.worker_pids()


def test_training_on_ray_matches_training_locally(ray_session):
    kw = dict(num_minibatches=2, update_epochs=2, n_steps=32, hidden_sizes=(16, 16), total_steps=256)
    local = PPO(RemoteEnv(ENV, parallel=4, workers=2, backend="local", seed=5), seed=5, **kw)
    with RemoteEnv(ENV, parallel=4, workers=2, backend="ray", seed=5) as env:
        on_ray = PPO(env, seed=5, **kw)
        on_ray.train(256)
    local.train(256)
    for key, value in local.policy.state_dict().items():
        assert torch.equal(value, on_ray.policy.state_dict()[key]), key


def broken_env_factory():
    import gymnasium as gym

    class Broken(gym.Env):
        observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return np.zeros(3, np.float32), {}  # wrong shape

        def step(self, action):
            return np.zeros(3, np.float32), 0.0, False, False, {}

    return Broken()


def test_broken_env_fails_on_the_worker_before_any_job(ray_session):
    import sys

    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules
    with pytest.raises((EnvValidationError, ray_session.exceptions.ActorDiedError), match="shape"):
        RemoteEnv(broken_env_factory, parallel=2, workers=1, backend="ray")


@remote(priority="high", num_cpus=0)  # the module's rollout actors may hold every CPU; the queue still orders
def started_at(delay: float) -> float:
    start = time.time()
    time.sleep(delay)
    return start


def hold_slot(started: str, release: str) -> float:
    """Occupy one dispatch slot until the test lets go (the test, not a clock, decides when a slot frees)."""
    Path(started).touch()
    while not Path(release).exists():
        time.sleep(0.01)
    return time.time()


def test_remote_function_value_future_and_priority(ray_session, tmp_path):
    assert started_at(0.0) > 0  # plain call blocks for the value
    capacity = int(ray_session.cluster_resources()["CPU"])
    low = remote(priority="low", num_cpus=0)(started_at.fn)
    holder = remote(priority="low", num_cpus=0)(hold_slot)
    blockers = [
        holder.remote_call(str(tmp_path / f"started{i}"), str(tmp_path / f"release{i}")) for i in range(capacity)
    ]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"started{i}").exists() for i in range(capacity)):  # every slot is taken
        assert time.monotonic() < deadline, "the slot holders never started"
        time.sleep(0.01)
    queued_low = [low.remote_call(0.0) for _ in range(3)]
    high = started_at.remote_call(0.0)  # submitted last, must take the first slot that frees
    (tmp_path / "release0").touch()  # exactly one slot frees: the queue gives it to `high`, and the lows wait for it
    high_start = high.result(timeout=120)
    for i in range(1, capacity):
        (tmp_path / f"release{i}").touch()
    assert high_start <= min(f.result(timeout=120) for f in queued_low)
    assert all(f.result(timeout=120) for f in blockers)


def test_remote_rejects_bad_options():
    with pytest.raises(ValueError, match="priority must be an int or one of"):
        remote(priority="urgent")(lambda: 1)
    with pytest.raises(ValueError, match="num_cpus/num_gpus must be >= 0"):
        remote(num_cpus=-1)(lambda: 1)
