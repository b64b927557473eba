"""``trainer.deploy()`` end to end: the SDK facade exports the trainer's policy and serves it over real HTTP."""

from __future__ import annotations

import socket
from urllib.parse import urlparse

import numpy as np
import psutil
import pytest
from typer.testing import CliRunner

from opentinker.serving.deploy import deploy

pytestmark = pytest.mark.slow  # starts real services or trains through a flow


def test_trainer_deploy_serves_the_trainers_policy_and_stop_cleans_up():
    from opentinker import PPOTrainer
    from opentinker.agents.export import load_policy

    trainer = PPOTrainer("CartPole-v1", seed=3, backend="local", num_envs=2, n_steps=16)
    trainer.train(steps=32)
    obs = np.random.default_rng(0).uniform(-0.2, 0.2, size=(48, 4)).astype(np.float32)
    with trainer.deploy(api_key="deploy-test-key-42") as service:
        exported = load_policy(service.model_ref)
        served = service.predict_batch(obs)
        np.testing.assert_array_equal(served, exported.act(obs))
        agreement = np.mean(served == trainer.policy.act(obs))
        assert agreement >= 0.95, f"served actions agree with the torch policy on only {agreement:.0%}"
        assert service.predict(obs[0]) == int(served[0])
        meta = service.metadata()
        assert meta["env_id"] == "CartPole-v1" and meta["model_version"].startswith("local-")
        children = psutil.Process(service.process.pid).children(recursive=True)
        assert children, "bentoml serve runs its workers as child processes"
    trainer.env.close()
    assert service.process.poll() is not None
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE], "worker left running"
    parsed = urlparse(service.url)
    with pytest.raises(OSError):
        socket.create_connection((parsed.hostname, parsed.port), timeout=1).close()


def test_deploy_fails_fast_with_the_reason(tmp_path):
    from opentinker.serving.deploy import DeploymentError
    from opentinker.tracking.registry import PolicyStoreError

    with pytest.raises(PolicyStoreError, match="export directory"):
        deploy(tmp_path / "not-an-export", api_key="some-key-123")
    broken = tmp_path / "broken-export"
    broken.mkdir()
    (broken / "policy.json").write_text("{}")
    with pytest.raises(DeploymentError, match="failed to start") as info:
        deploy(broken, api_key="some-key-123", ready_timeout_s=120)
    assert "format_version" in str(info.value), "the log tail says why"


def test_serve_command_refuses_to_start_without_a_key(monkeypatch):
    from opentinker.cli import app

    monkeypatch.delenv("OPENTINKER_API_KEY", raising=False)
    result = CliRunner().invoke(app, ["serve", "models:/x@champion"])
    assert result.exit_code == 1 and "API key is required" in result.output
    result = CliRunner().invoke(app, ["serve", "models:/x@champion", "--api-key", "a long key"])
    assert result.exit_code == 1 and "whitespace" in result.output
    result = CliRunner().invoke(app, ["serve", "/no/such/export", "--api-key", "long-enough-key"])
    assert result.exit_code == 1 and "export directory" in result.output
