"""GAE against values worked out by hand, and against a plain per-env reference loop on random data."""

from __future__ import annotations

import numpy as np
import pytest

from opentinker.agents.advantages import compute_gae

GAMMA, LAM = 0.5, 0.5


def col(*xs, dtype=np.float32):
    return np.array(xs, dtype=dtype)[:, None]  # (T, 1): one env


def test_no_episode_end():
    # deltas: 1 + .5*1 - 1 = .5 ; 2 + .5*1 - 1 = 1.5 ; 3 + .5*2 - 1 = 3
    # A2 = 3 ; A1 = 1.5 + .25*3 = 2.25 ; A0 = .5 + .25*2.25 = 1.0625
    adv, ret = compute_gae(
        col(1, 2, 3),
        col(1, 1, 1),
        col(0, 0, 0, dtype=bool),
        col(0, 0, 0, dtype=bool),
        np.array([2.0], np.float32),
        GAMMA,
        LAM,
    )
    assert adv[:, 0] == pytest.approx([1.0625, 2.25, 3.0])
    assert ret[:, 0] == pytest.approx([2.0625, 3.25, 4.0])


def test_termination_cuts_bootstrap_and_recursion():
    # t=1 terminates: delta1 = 2 - 1 = 1 (no bootstrap), A1 = 1 ; A0 = .5 + .25*1 = .75
    adv, _ = compute_gae(
        col(1, 2, 0),
        col(1, 1, 1),
        col(0, 1, 0, dtype=bool),
        col(0, 0, 0, dtype=bool),
        np.array([2.0], np.float32),
        GAMMA,
        LAM,
    )
    assert adv[:2, 0] == pytest.approx([0.75, 1.0])


def test_truncation_bootstraps_from_the_final_observation():
    # t=1 truncates; values[2] = 4 is the value of the final observation: delta1 = 2 + .5*4 - 1 = 3, A1 = 3
    # A0 = .5 + .25*3 = 1.25
    adv, _ = compute_gae(
        col(1, 2, 0),
        col(1, 1, 4),
        col(0, 0, 0, dtype=bool),
        col(0, 1, 0, dtype=bool),
        np.array([2.0], np.float32),
        GAMMA,
        LAM,
    )
    assert adv[:2, 0] == pytest.approx([1.25, 3.0])


def reference_gae(rewards, values, terminated, truncated, last_values, gamma, lam):
    T, N = rewards.shape
    adv = np.zeros((T, N))
    for env in range(N):
        running = 0.0
        for t in reversed(range(T)):
            next_value = last_values[env] if t == T - 1 else values[t + 1, env]
            bootstrap = 0.0 if terminated[t, env] else gamma * next_value
            delta = rewards[t, env] + bootstrap - values[t, env]
            if terminated[t, env] or truncated[t, env]:
                running = 0.0
            running = delta + gamma * lam * running
            adv[t, env] = running
    return adv


def test_matches_reference_loop_on_random_rollouts():
    rng = np.random.default_rng(0)
    T, N = 37, 5
    rewards = rng.normal(size=(T, N)).astype(np.float32)
    values = rng.normal(size=(T, N)).astype(np.float32)
    terminated = rng.random((T, N)) < 0.1
    truncated = (rng.random((T, N)) < 0.05) & ~terminated
    last = rng.normal(size=N).astype(np.float32)
    adv, ret = compute_gae(rewards, values, terminated, truncated, last, 0.99, 0.95)
    np.testing.assert_allclose(
        adv, reference_gae(rewards, values, terminated, truncated, last, 0.99, 0.95), rtol=1e-4, atol=1e-4
    )
    np.testing.assert_allclose(ret, adv + values, rtol=1e-6)
