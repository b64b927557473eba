"""Mixed precision: autocast really runs in the chosen dtype; safe mode skips a NaN step and falls back to fp32."""

from __future__ import annotations

import logging

import pytest
import torch

from opentinker.agents import DQN, PPO

KW = dict(num_envs=8, n_steps=16, num_minibatches=2, update_epochs=2)  # 4 optimiser steps per iteration


def record_dtypes(module: torch.nn.Module) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    module.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype) if torch.is_grad_enabled() else None)
    return seen


@pytest.mark.parametrize("mode, dtype", [("off", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_dtype_per_mode(mode, dtype):
    trainer = PPO("CartPole-v1", seed=0, device="cpu", amp_mode=mode, **KW)
    seen = record_dtypes(trainer.policy.actor[0])
    metrics = trainer.train(128)
    assert seen and set(seen) == {dtype}
    assert all(torch.isfinite(p).all() for p in trainer.policy.parameters())
    assert metrics["perf/amp_active"] == float(mode != "off")


def test_safe_mode_skips_a_nan_step_and_falls_back_to_fp32(caplog):
    trainer = PPO("CartPole-v1", seed=0, device="cpu", amp_mode="safe", **KW)
    dtypes = record_dtypes(trainer.policy.actor[0])
    injected = []

    def poison_once(module, inputs, output):  # the first training forward of the critic returns NaN
        if torch.is_grad_enabled() and not injected:
            injected.append(True)
            return output * float("nan")
        return output

    trainer.policy.critic.register_forward_hook(poison_once)
    with caplog.at_level(logging.WARNING, logger="opentinker.agents"):
        metrics = trainer.train(256)  # 2 iterations, 8 optimiser steps attempted
    assert injected
    assert trainer.amp.fallback_reason.startswith("non-finite loss")
    assert "continuing in fp32" in caplog.text
    assert metrics["perf/amp_active"] == 0.0 and metrics["perf/amp_skipped_steps"] == 1.0
    assert dtypes[0] == torch.bfloat16 and set(dtypes[1:]) == {torch.float32}
    step_counts = {int(s["step"]) for s in trainer.optimizer.state.values()}
    assert step_counts == {7}  # the poisoned step was not applied
    assert all(torch.isfinite(p).all() for p in trainer.policy.parameters())


def test_safe_mode_fallback_survives_a_checkpoint(tmp_path):
    trainer = DQN(
        "CartPole-v1",
        seed=0,
        device="cpu",
        amp_mode="safe",
        num_envs=2,
        n_steps=8,
        learning_starts=16,
        batch_size=8,
        buffer_size=64,
    )
    trainer.amp.fallback_reason = "non-finite gradients under torch.bfloat16"
    resumed = DQN.load(trainer.save(tmp_path / "c.pt"))
    assert not resumed.amp.active and resumed.amp.fallback_reason == trainer.amp.fallback_reason


def test_device_auto_picks_what_exists():
    trainer = PPO("CartPole-v1", seed=0, **KW)
    assert trainer.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            PPO("CartPole-v1", device="cuda", **KW)
