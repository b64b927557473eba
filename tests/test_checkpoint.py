"""Checkpoints: resume-then-train gives bit-identical weights to an uninterrupted run; writes are atomic."""

from __future__ import annotations

import os

import pytest
import torch

from opentinker.agents import DQN, PPO

PPO_KW = dict(num_envs=8, n_steps=16, num_minibatches=2, update_epochs=2, total_steps=8 * 16 * 6)
DQN_KW = dict(
    num_envs=4,
    n_steps=8,
    learning_starts=64,
    train_frequency=4,
    batch_size=32,
    buffer_size=1000,
    target_network_frequency=96,
    total_steps=4 * 8 * 12,
)


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize(
    "cls, env_id, kw, steps, split",
    [
        (PPO, "CartPole-v1", PPO_KW, 8 * 16 * 6, 8 * 16 * 3),
        (PPO, "Pendulum-v1", dict(PPO_KW, num_envs=4), 4 * 16 * 6, 4 * 16 * 2),
        (PPO, "Pendulum-v1", dict(PPO_KW, num_envs=4, norm_obs=True, norm_reward=True), 4 * 16 * 6, 4 * 16 * 2),
        (DQN, "CartPole-v1", DQN_KW, 4 * 8 * 12, 4 * 8 * 5),
    ],
)
def test_resume_is_bit_exact(tmp_path, cls, env_id, kw, steps, split):
    kw = dict(kw, total_steps=steps)
    straight = cls(env_id, seed=7, **kw)
    straight.train(steps)

    first = cls(env_id, seed=7, **kw)
    first.train(split)
    path = first.save(tmp_path / "ckpt.pt")
    del first
    resumed = cls.load(path)
    assert resumed.global_step == split
    resumed.train(steps)

    assert resumed.global_step == straight.global_step == steps
    assert_same_state(straight.policy.state_dict(), resumed.policy.state_dict())
    opt_a, opt_b = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    for idx in opt_a:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_a[idx][name], opt_b[idx][name])
    if cls is DQN:
        assert_same_state(straight.target.state_dict(), resumed.target.state_dict())
        assert len(straight.buffer) == len(resumed.buffer)
    assert straight.evaluate(2).returns == resumed.evaluate(2).returns


def test_train_writes_checkpoints_and_resumes_from_a_directory(tmp_path):
    trainer = PPO("CartPole-v1", seed=1, **PPO_KW)
    seen = []
    trainer.train(8 * 16 * 4, callback=lambda m, step: seen.append(step), checkpoint_dir=tmp_path, checkpoint_every=256)
    assert seen == [128, 256, 384, 512]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.pt"]  # no temp files left behind
    resumed = PPO.load(tmp_path)
    assert resumed.global_step == 512 and resumed.iteration == 4


def test_callback_false_stops_training():
    trainer = PPO("CartPole-v1", seed=1, **PPO_KW)
    trainer.train(10_000, callback=lambda m, step: step < 256)
    assert trainer.global_step == 256


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    trainer = PPO("CartPole-v1", seed=1, **PPO_KW)
    path = trainer.save(tmp_path / "ckpt.pt")
    before = path.read_bytes()

    def torn_write(obj, fh):
        fh.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", torn_write)
    with pytest.raises(OSError, match="disk full"):
        trainer.save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_load_rejects_the_wrong_algorithm(tmp_path):
    path = PPO("CartPole-v1", seed=1, **PPO_KW).save(tmp_path / "ppo.pt")
    with pytest.raises(ValueError, match="holds a ppo checkpoint, not dqn"):
        DQN.load(path)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        PPO.load(tmp_path / "missing.pt")
