"""SAC through the whole pipeline: ``train_flow`` → MLflow run and registry (the gate without a reward threshold) →
the registered actor served over HTTP acts as the trained one in-process (deterministic tanh of the mean, scaled to
the Box bounds)."""

from __future__ import annotations

import mlflow
import numpy as np
import pytest

from opentinker.infra.settings import get_settings

pytestmark = pytest.mark.slow
IDENTITY = "opentinker.envs.identity:BoxIdentityEnv"


def test_sac_flow_registers_and_serves_the_actor():
    from opentinker.agents import SAC
    from opentinker.flows.params import TrainParams
    from opentinker.flows.train import train_flow
    from opentinker.serving.deploy import deploy
    from opentinker.tracking.registry import load_registered_policy

    result = train_flow(
        TrainParams(
            env_id=IDENTITY,
            algorithm="sac",
            steps=1536,
            seed=3,
            eval_episodes=3,
            model_name="flow-sac",
            run_name="flow-sac",
            sac={"hidden_sizes": (32, 32), "batch_size": 64, "learning_starts": 256, "learning_rate": 3e-3},
        )
    )
    run = mlflow.MlflowClient(get_settings().tracking_uri).get_run(result.run_id)
    assert run.data.params["algorithm"] == "sac" and run.data.params["sac.learning_starts"] == "256"
    assert "losses/critic" in run.data.metrics and "charts/alpha" in run.data.metrics
    assert result.eval_mean > 15.0  # learned: an untrained actor scores about 12 of the best 16
    assert "champion" in result.aliases  # the gate: beats a random policy by a clear margin

    trainer = SAC.load(result.checkpoint_path, device="cpu")
    obs = np.array([[-0.9], [-0.2], [0.0], [0.4], [0.95]], np.float32)
    in_process = trainer.policy.act(obs)
    trainer.env.close()
    np.testing.assert_allclose(in_process[:, 0], obs[:, 0], atol=0.35)  # the identity, roughly
    registered = load_registered_policy(f"models:/{result.model_name}/{result.model_version}")
    np.testing.assert_allclose(registered.act(obs), in_process, rtol=1e-5, atol=1e-6)
    with deploy(f"models:/{result.model_name}@champion", "sac-flow-key") as server:
        assert server.metadata()["algorithm"] == "sac"
        over_http = np.array([server.predict(o.tolist()) for o in obs], np.float32)
    np.testing.assert_allclose(over_http, in_process, rtol=1e-5, atol=1e-6)
