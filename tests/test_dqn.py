"""DQN: target-network update rule, replay buffer, epsilon schedule, a short run that learns."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opentinker.agents import DQN, DQNConfig
from opentinker.agents.buffers import ReplayBuffer
from opentinker.agents.dqn import linear_schedule
from opentinker.envs import EnvSpecError

TINY = dict(num_envs=2, n_steps=4, learning_starts=8, batch_size=4, buffer_size=64, target_network_frequency=8)


def test_target_update_hard_and_soft():
    trainer = DQN("CartPole-v1", seed=0, **TINY)
    with torch.no_grad():
        for p in trainer.policy.parameters():
            p.fill_(1.0)
        for p in trainer.target.parameters():
            p.fill_(3.0)
    trainer.config.tau = 0.25
    trainer.update_target()  # 0.25 * 1 + 0.75 * 3 = 2.5
    assert all(torch.allclose(p, torch.full_like(p, 2.5)) for p in trainer.target.parameters())
    trainer.config.tau = 1.0
    trainer.update_target()
    assert all(torch.equal(p, q) for p, q in zip(trainer.target.parameters(), trainer.policy.parameters()))


def test_target_network_follows_its_frequency():
    trainer = DQN("CartPole-v1", seed=0, **dict(TINY, target_network_frequency=24))
    trainer.train(16)  # 2 iterations of 8 steps: before the first target update at 24
    assert not all(torch.equal(p, q) for p, q in zip(trainer.target.parameters(), trainer.policy.parameters()))
    trainer.train(24)
    assert all(torch.equal(p, q) for p, q in zip(trainer.target.parameters(), trainer.policy.parameters()))
    assert trainer.next_target_update == 48


def test_replay_buffer_wraps_and_round_trips():
    buf = ReplayBuffer(5)
    for start in (0, 3):
        obs = np.arange(start, start + 3, dtype=np.float32)[:, None]
        buf.add(obs, obs + 1, np.arange(3), np.ones(3, np.float32), np.zeros(3, np.float32))
    assert len(buf) == 5 and buf.pos == 1
    assert sorted(buf.data["obs"][:, 0].tolist()) == [1.0, 2.0, 3.0, 4.0, 5.0]  # 0 was overwritten by 5
    copy = ReplayBuffer(5)
    copy.load_state_dict(buf.state_dict())
    a, b = buf.sample(8, np.random.default_rng(1)), copy.sample(8, np.random.default_rng(1))
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_epsilon_schedule_and_config_errors():
    assert linear_schedule(1.0, 0.05, 100, 0) == 1.0
    assert linear_schedule(1.0, 0.05, 100, 50) == pytest.approx(0.525)
    assert linear_schedule(1.0, 0.05, 100, 500) == 0.05
    with pytest.raises(ValueError, match=r"buffer_size must be >= batch_size \(128\)"):
        DQNConfig(buffer_size=10)
    with pytest.raises(EnvSpecError, match="expected Discrete"):
        DQN("Pendulum-v1")


def test_dqn_learns_cartpole():
    trainer = DQN(
        "CartPole-v1",
        seed=0,
        num_envs=8,
        n_steps=16,
        learning_rate=1e-3,
        learning_starts=1000,
        train_frequency=4,
        batch_size=64,
        target_network_frequency=500,
        exploration_fraction=0.4,
        buffer_size=20_000,
        total_steps=15_000,
    )
    before = trainer.evaluate(5).mean
    metrics = trainer.train(12_000)
    after = trainer.evaluate(5).mean
    assert metrics["charts/epsilon"] == pytest.approx(0.05)
    assert after >= max(3 * before, 60), (before, after)
