"""PPO: loss pieces against hand-computed values, the public trainer API, and short runs that learn."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from opentinker.agents import PPO, PPOConfig
from opentinker.agents.export import export_policy, load_policy
from opentinker.agents.ppo import clipped_policy_loss, explained_variance, normalize, value_loss
from opentinker.envs import EnvSpecError
from opentinker.envs.base import EnvSpaces

DASHBOARD_METRICS = {
    "charts/episodic_return_mean",
    "charts/episodic_return_min",
    "charts/episodic_return_max",
    "charts/sps",
    "losses/policy",
    "losses/value",
    "losses/entropy",
    "losses/approx_kl",
    "losses/explained_variance",
    "perf/rollout_efficiency",
    "perf/gradient_delay_ms",
    "perf/policy_lag",
    "perf/rollout_bytes",
}


def test_clipped_policy_loss_by_hand():
    # A=+1, r=1.5: max(-1.5, -1.2) = -1.2 ; A=-1, r=0.5: max(0.5, 0.8) = 0.8 ; mean = -0.2
    loss = clipped_policy_loss(torch.tensor([1.0, -1.0]), torch.tensor([1.5, 0.5]), 0.2)
    assert loss.item() == pytest.approx(-0.2)
    # inside the trust region the loss is the plain surrogate -A * r
    assert clipped_policy_loss(torch.tensor([2.0]), torch.tensor([1.1]), 0.2).item() == pytest.approx(-2.2)


def test_value_loss_clipping_by_hand():
    new, old, ret = torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([3.0])
    assert value_loss(new, old, ret, None).item() == pytest.approx(0.5)  # 0.5 * (2 - 3)^2
    # clipped prediction 0 + clamp(2, -.5, .5) = .5: 0.5 * max(1, (0.5 - 3)^2) = 3.125
    assert value_loss(new, old, ret, 0.5).item() == pytest.approx(3.125)


def test_normalize_and_explained_variance():
    adv = normalize(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert adv.mean().item() == pytest.approx(0.0, abs=1e-6) and adv.std().item() == pytest.approx(1.0, abs=1e-4)
    assert explained_variance(np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.0])) == pytest.approx(1.0)
    assert explained_variance(np.zeros(3), np.array([1.0, 2.0, 3.0])) == pytest.approx(0.0)
    assert explained_variance(np.array([3.0, 2.0, 1.0]), np.array([1.0, 2.0, 3.0])) == pytest.approx(-3.0)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="unknown PPOConfig field"):
        PPO("CartPole-v1", n_stepz=4)
    with pytest.raises(ValueError, match="gae_lambda must be in \\[0, 1\\]"):
        PPOConfig(gae_lambda=1.5)
    with pytest.raises(ValueError, match="amp_mode must be one of"):
        PPO("CartPole-v1", amp_mode="fp8")
    graph = gym.spaces.Graph(gym.spaces.Box(0.0, 1.0, (3,)), gym.spaces.Discrete(2))
    with pytest.raises(EnvSpecError, match=r"observation_space Graph\(.* is not supported: expected Box"):
        PPO(EnvSpaces("graph", graph, gym.spaces.Discrete(2)))


def test_every_config_field_is_documented():
    import ast
    import inspect

    from opentinker.agents import config

    tree = ast.parse(inspect.getsource(config))
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), f"{cls.name}.{node.target.id}"


def test_metrics_policy_act_and_export_round_trip(tmp_path):
    trainer = PPO("CartPole-v1", seed=0, num_envs=16, n_steps=32)
    seen = []
    trainer.train(16 * 32 * 3, callback=lambda m, step: seen.append((step, m)))
    assert [s for s, _ in seen] == [512, 1024, 1536]
    assert DASHBOARD_METRICS <= set(seen[-1][1])
    assert 0.0 < seen[-1][1]["perf/rollout_efficiency"] <= 1.0
    obs = np.random.default_rng(0).uniform(-0.1, 0.1, (5, 4)).astype(np.float32)
    actions = trainer.policy.act(obs)
    assert actions.shape == (5,) and actions.dtype == np.int64
    assert trainer.policy.act(obs[0]).shape == ()
    exported = load_policy(export_policy(trainer, tmp_path / "export", metadata={"run": "abc"}))
    assert exported.spec["metadata"] == {"run": "abc"} and exported.spec["env_id"] == "CartPole-v1"
    np.testing.assert_array_equal(exported.act(obs), actions)
    _acts, probs, values = exported.act_with_info(obs)
    assert probs.shape == (5, 2) and np.allclose(probs.sum(1), 1) and values.shape == (5,)
    with pytest.raises(ValueError, match=r"expected \(batch, 4\)"):
        exported.act(np.zeros((2, 3)))


def test_ppo_learns_cartpole():
    trainer = PPO(
        "CartPole-v1",
        seed=0,
        num_envs=64,
        n_steps=32,
        learning_rate=1e-3,
        gamma=0.98,
        gae_lambda=0.8,
        ent_coef=0.0,
        total_steps=200_000,
    )
    curve = []
    trainer.train(45_000, callback=lambda m, step: curve.append(m.get("charts/episodic_return_mean", 0.0)))
    first, last = curve[0], float(np.mean(curve[-5:]))
    assert first < 40 and last >= 100, curve


def test_ppo_learns_pendulum_continuous():
    trainer = PPO(
        "Pendulum-v1",
        seed=0,
        num_envs=16,
        n_steps=128,
        learning_rate=1e-3,
        gamma=0.9,
        gae_lambda=0.95,
        ent_coef=0.0,
        update_epochs=10,
        num_minibatches=8,
        reward_scale=0.1,
        clip_vloss=False,
        total_steps=100_000,
    )
    before = trainer.evaluate(5).mean
    trainer.train(32_768)
    after = trainer.evaluate(5).mean
    actions = trainer.policy.act(np.zeros((3, 3), np.float32), deterministic=False)
    assert actions.shape == (3, 1) and np.all(np.abs(actions) <= 2.0)
    assert after > before + 250, (before, after)
