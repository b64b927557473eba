"""PPO learns each shipped identity env (Dict observations through the combined extractor, MultiDiscrete and
MultiBinary actions, a small image through the CNN) in seconds; DQN trains on images with a uint8 replay buffer; and
checkpoints of these policies resume bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opentinker.agents import DQN, PPO

ENVS = "opentinker.envs.identity:"
LEARN = dict(num_envs=16, n_steps=32, learning_rate=3e-3, gamma=0.5)
"""Identity tasks: every step's reward depends on that step's action only, so a short horizon learns fastest."""
BEST_RETURN = 16.0  # episode_length steps, reward 1 each when the whole target is matched


@pytest.mark.parametrize(
    "env, steps",
    [
        ("DictIdentityEnv", 8_192),
        ("MultiDiscreteIdentityEnv", 8_192),
        ("MultiBinaryIdentityEnv", 8_192),
        ("ImageIdentityEnv", 8_192),
    ],
)
def test_ppo_learns_every_kind_of_space_in_seconds(env, steps):
    trainer = PPO(ENVS + env, seed=0, device="cpu", **LEARN)
    random_return = trainer.evaluate(episodes=8).mean  # the untrained policy: about chance
    trainer.train(steps)
    result = trainer.evaluate(episodes=8)
    trainer.env.close()
    assert random_return < 0.7 * BEST_RETURN
    assert result.mean >= 0.9 * BEST_RETURN, (env, random_return, result)


def _same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize(
    "cls, env, kw, steps, split",
    [
        (PPO, "DictIdentityEnv", dict(num_envs=4, n_steps=16, num_minibatches=2, update_epochs=2), 512, 192),
        (PPO, "MultiBinaryIdentityEnv", dict(num_envs=4, n_steps=16, state_diff=True), 512, 256),
        (
            DQN,
            "ImageIdentityEnv",
            dict(num_envs=2, n_steps=16, learning_starts=32, batch_size=16, buffer_size=256, train_frequency=8),
            256,
            128,
        ),
    ],
)
def test_checkpoints_of_structured_policies_resume_bit_exact(tmp_path, cls, env, kw, steps, split):
    kw = dict(kw, total_steps=steps)
    straight = cls(ENVS + env, seed=5, device="cpu", **kw)
    straight.train(steps)
    first = cls(ENVS + env, seed=5, device="cpu", **kw)
    first.train(split)
    path = first.save(tmp_path / "checkpoint.pt")
    first.env.close()
    resumed = cls.load(path, device="cpu")
    resumed.train(steps)
    assert resumed.global_step == straight.global_step == steps
    _same_weights(straight.policy.state_dict(), resumed.policy.state_dict())
    assert any(k.startswith("features.") for k in straight.policy.state_dict()) == (env != "MultiBinaryIdentityEnv")
    if cls is DQN:
        assert resumed.buffer.data["obs"].dtype == np.uint8  # replayed images stay bytes
        np.testing.assert_array_equal(resumed.buffer.data["obs"], straight.buffer.data["obs"])
    for trainer in (straight, resumed):
        trainer.env.close()
