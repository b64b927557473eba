"""SAC and TD3: they learn the continuous identity task, resume bit-exactly, refuse what they cannot handle, and the
exported actor acts as the trained one (deterministic tanh of the mean, scaled to the Box bounds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opentinker.agents import SAC, TD3
from opentinker.agents.export import export_policy, load_policy
from opentinker.envs import EnvSpecError

IDENTITY = "opentinker.envs.identity:BoxIdentityEnv"
SMALL = dict(hidden_sizes=(32, 32), batch_size=64, learning_starts=256, buffer_size=5000, learning_rate=3e-3)


@pytest.mark.parametrize("cls", [SAC, TD3])
def test_learns_the_continuous_identity(cls):
    trainer = cls(IDENTITY, seed=0, backend="local", **SMALL)
    before = trainer.evaluate(5).mean  # an untrained actor answers ~0: about 12 of the best 16 per episode
    metrics = trainer.train(1200)
    after = trainer.evaluate(5).mean
    assert before < 13 and after > 15, (before, after)
    assert (
        np.isfinite(metrics["losses/critic"]) and 1100 < metrics["charts/buffer_size"] < 1200
    )  # reset steps hold no transition


@pytest.mark.parametrize(
    "cls, kw",
    [
        (SAC, dict(SMALL, learning_starts=64, n_steps=8, num_envs=2)),
        (SAC, dict(SMALL, learning_starts=64, alpha=0.2, train_frequency=2, state_diff=True)),
        (TD3, dict(SMALL, learning_starts=64, n_steps=4, num_envs=2, policy_delay=3)),
    ],
)
def test_resume_is_bit_exact(tmp_path, cls, kw):
    steps, split = 320, 160
    straight = cls("Pendulum-v1", seed=5, backend="local", **kw)
    straight.train(steps)
    first = cls("Pendulum-v1", seed=5, backend="local", **kw)
    first.train(split)
    resumed = cls.load(first.save(tmp_path / "ckpt.pt"))
    del first
    resumed.train(steps)
    assert resumed.global_step == straight.global_step == steps
    for name in ("policy", "critic", "critic_target", *(["actor_target"] if cls is TD3 else [])):
        a, b = getattr(straight, name).state_dict(), getattr(resumed, name).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    for name in ("optimizer", "critic_optimizer", *(["alpha_optimizer"] if cls is SAC else [])):
        a, b = getattr(straight, name).state_dict()["state"], getattr(resumed, name).state_dict()["state"]
        assert all(torch.equal(a[i]["exp_avg_sq"], b[i]["exp_avg_sq"]) for i in a), name
    if cls is SAC:
        assert torch.equal(straight.log_alpha, resumed.log_alpha)
    assert np.array_equal(straight.buffer.data["obs"], resumed.buffer.data["obs"])
    assert straight.evaluate(2).returns == resumed.evaluate(2).returns


def test_exported_actor_is_the_deterministic_scaled_tanh(tmp_path):
    trainer = SAC("Pendulum-v1", seed=1, backend="local", **dict(SMALL, learning_starts=64))
    trainer.train(128)
    served = load_policy(export_policy(trainer, tmp_path / "export"))
    obs = np.random.default_rng(0).uniform(-8, 8, (16, 3)).astype(np.float32)
    with torch.no_grad():
        mean = trainer.policy.actor(torch.as_tensor(obs))[:, :1]
    expected = (2.0 * torch.tanh(mean)).numpy()  # Pendulum's bounds are [-2, 2]
    np.testing.assert_allclose(served.act(obs), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(trainer.policy.act(obs), expected, rtol=1e-6, atol=1e-6)
    assert served.spec["algorithm"] == "sac" and served.act_with_info(obs)[2] is None
    assert served.act(np.full((1, 3), 1e6, np.float32)).max() <= 2.0  # saturated: still inside the bounds


def test_refusals_name_the_field():
    with pytest.raises(EnvSpecError, match=r"action_space Discrete.*expected a Box"):
        SAC("CartPole-v1")
    with pytest.raises(ValueError, match=r"alpha must be None \(learned\) or > 0"):
        SAC(IDENTITY, alpha=0.0)
    with pytest.raises(ValueError, match="policy_delay must be an int >= 1"):
        TD3(IDENTITY, policy_delay=0)
    with pytest.raises(ValueError, match="'epsilon_decay' does not apply to algorithm 'sac'"):
        SAC(IDENTITY, epsilon_decay=0.9)


def test_amp_auto_is_bf16_where_native_and_checkpoints_keep_auto(tmp_path):
    from opentinker.agents.amp import native_bf16

    trainer = SAC(IDENTITY, seed=0, backend="local", **dict(SMALL, learning_starts=64))
    metrics = trainer.train(256)
    assert trainer.amp.requested == "auto" and np.isfinite(metrics["losses/critic"])
    assert metrics["perf/amp_active"] == float(native_bf16(trainer.device))
    assert SAC.load(trainer.save(tmp_path / "ckpt.pt")).amp.requested == "auto"
    assert TD3(IDENTITY, backend="local", amp_mode="off").amp.mode == "off"
