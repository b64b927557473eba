"""Any algorithm and any env through the pipeline: DQN and continuous PPO flows register models that are served
over HTTP; a ``module:Class`` env trains from the CLI on Ray workers; the gate without a reward threshold;
observation statistics survive checkpoint -> export -> serving; bad input exits 1 with one line."""

from __future__ import annotations

import json
import os

import mlflow
import numpy as np
import pytest
from fixtures.serving import deploy_all
from typer.testing import CliRunner

from opentinker.cli import app
from opentinker.infra.settings import get_settings

pytestmark = pytest.mark.slow
API_KEY = "flow-algorithms-key"


def _client() -> mlflow.MlflowClient:
    return mlflow.MlflowClient(get_settings().tracking_uri)


def test_dqn_and_continuous_ppo_flows_are_registered_gated_and_served():
    from opentinker.agents import PPO
    from opentinker.flows.params import TrainParams
    from opentinker.flows.train import train_flow
    from opentinker.tracking.registry import load_registered_policy

    dqn = train_flow(
        TrainParams(
            env_id="CartPole-v1",
            algorithm="dqn",
            steps=2048,
            seed=2,
            eval_episodes=2,
            champion_threshold=0.0,
            model_name="algo-dqn",
            run_name="algo-dqn",
        )
    )
    pendulum = train_flow(
        TrainParams(
            env_id="Pendulum-v1",
            steps=4096,
            seed=2,
            eval_episodes=2,
            ppo={"norm_obs": True},
            model_name="algo-pendulum",
            run_name="algo-pendulum",
        )
    )
    client = _client()
    dqn_run, pendulum_run = client.get_run(dqn.run_id), client.get_run(pendulum.run_id)
    assert dqn_run.data.params["algorithm"] == "dqn" and dqn_run.data.params["dqn.batch_size"] == "64"  # preset
    assert dqn_run.data.params["backend"] == "local" and "losses/td_loss" in dqn_run.data.metrics
    assert pendulum_run.data.params["ppo.norm_obs"] == "True" and pendulum_run.data.params["ppo.gamma"] == "0.9"

    # Pendulum has no reward_threshold: the first model must beat a random policy on the same seeds.
    assert pendulum.threshold is None
    version = client.get_model_version(pendulum.model_name, pendulum.model_version)
    for tags in (pendulum_run.data.tags, version.tags):
        assert tags["gate.rule"].startswith("beat champion") and tags["gate.threshold"] == ""
        assert float(tags["gate.random_floor"]) > float(tags["gate.random_mean"])
        assert tags["gate.decision"] == pendulum.decision and "random policy" in pendulum.decision
    assert ("champion" in pendulum.aliases) == pendulum.decision.startswith("promoted")

    # Observation statistics: learned, in the checkpoint, in the registered export, applied when serving.
    trainer = PPO.load(pendulum.checkpoint_path, device="cpu")
    assert float(trainer.policy.obs_count) > 4096 - 100 and np.any(trainer.policy.obs_mean.numpy() != 0)
    trainer.env.close()
    served_pendulum = load_registered_policy(f"models:/{pendulum.model_name}/{pendulum.model_version}")
    obs = np.array([[0.6, -0.8, 1.5], [-1.0, 0.0, -7.0]], np.float32)
    in_process = trainer.policy.act(obs)
    np.testing.assert_allclose(served_pendulum.act(obs), in_process, rtol=1e-5, atol=1e-5)

    dqn_ref, pendulum_ref = (f"models:/{r.model_name}/{r.model_version}" for r in (dqn, pendulum))
    dqn_server, pendulum_server = deploy_all(API_KEY, [dqn_ref, pendulum_ref])
    try:
        assert dqn_server.predict([0.01, 0.02, -0.03, 0.04]) in (0, 1)
        assert dqn_server.metadata()["action_space"]["type"] == "Discrete"
        meta = pendulum_server.metadata()
        assert meta["algorithm"] == "ppo"
        assert meta["action_space"] | {"repr": ""} == {
            "repr": "",
            "type": "Box",
            "low": [-2.0],
            "high": [2.0],
            "shape": [1],
            "dtype": "float32",
        }
        over_http = np.array([pendulum_server.predict(o.tolist()) for o in obs], np.float32)
        np.testing.assert_allclose(over_http, in_process, rtol=1e-5, atol=1e-5)
        far = pendulum_server.predict([1.0, 0.0, 8.0])  # saturating input: the action is clipped into the space
        assert -2.0 <= far[0] <= 2.0
    finally:
        dqn_server.stop()
        pendulum_server.stop()


def test_a_module_class_env_trains_from_the_cli_on_ray_workers(tmp_path):
    config = tmp_path / "corridor.toml"
    config.write_text(
        'workers = 2\nnum_envs = 4\neval_episodes = 2\nmodel_name = "corridor"\n'
        'run_name = "corridor"\n[ppo]\nn_steps = 32\n'
    )
    result = CliRunner().invoke(app, ["train", "fixtures.corridor:Corridor", "--steps", "512", "--config", str(config)])
    assert result.exit_code == 0, result.output
    client = _client()
    version = client.get_model_version_by_alias("corridor", "candidate")
    run = client.get_run(version.run_id)
    assert run.data.params["env_id"] == "fixtures.corridor:Corridor" and run.data.params["backend"] == "ray"
    nodes = run.data.tags["opentinker.rollout_nodes"].split(",")
    assert len(nodes) == 2 and "local" not in nodes  # stepped inside Ray actors, which imported the module
    from opentinker.tracking.registry import load_registered_policy

    spec = load_registered_policy(f"models:/corridor/{version.version}").spec
    assert spec["env_id"] == "fixtures.corridor:Corridor"  # how evaluation rebuilds the env
    assert version.tags["gate.rule"].startswith("beat champion")  # the env has no reward threshold


@pytest.mark.parametrize(
    ("args", "config", "expected"),
    [
        (["train", "CartPole-v1", "--algo", "a2c"], None, "algorithm"),
        (["train", "no_such_pkg.envs:MyEnv"], None, "env_id"),
        (["train", "Pendulum-v1", "--algo", "dqn"], None, "algorithm"),
        (["train", "CartPole-v1", "--algo", "dqn"], "[dqn]\nbatch_sise = 32\n", "dqn"),
        (["train", "CartPole-v1"], "[dqn]\nbatch_size = 32\n", "dqn"),
        (["train", "CartPole-v1"], "[ppo]\nnum_envs = 32\n", "num_envs"),
    ],
)
def test_bad_algorithm_env_or_override_exits_1_with_one_line(tmp_path, args, config, expected):
    if config is not None:
        path = tmp_path / "bad.toml"
        path.write_text(config)
        args = [*args, "--config", str(path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], result.output


def test_gate_without_threshold_beats_champion_or_random_floor():
    from opentinker.agents.evaluation import EvalResult
    from opentinker.tasks.register import decide, random_floor

    random = EvalResult(model_key="random/x", seed=0, returns=[-200.0, -200.0], mean=-200.0, std=0.0)
    floor = random_floor(random)
    assert floor == pytest.approx(-180.0)  # 10 % of the magnitude when every random episode is alike
    assert decide(-200.0, None, None, floor)[0] is False  # no better than random
    assert decide(-150.0, None, None, floor)[0] is True
    assert decide(-150.0, -140.0, None)[0] is False and decide(-130.0, -140.0, None)[0] is True


def test_a_trainer_refuses_num_envs_that_contradicts_its_remote_env():
    from opentinker.agents import PPO
    from opentinker.envs import RemoteEnv

    with RemoteEnv("CartPole-v1", parallel=4, backend="local") as env:
        with pytest.raises(ValueError, match="num_envs=8 conflicts"):
            PPO(env, num_envs=8)
        assert PPO(env).config.num_envs == 4


def test_sdk_train_with_track_logs_the_flow_layout():
    from opentinker import PPOTrainer

    trainer = PPOTrainer("CartPole-v1", seed=4, num_envs=4, n_steps=32, backend="local")
    result = trainer.train(512, track=True, run_name="sdk-tracked", model_name="sdk-tracked", eval_episodes=2)
    client = _client()
    run = client.get_run(trainer.last_run_id)
    assert run.info.status == "FINISHED" and run.data.params["algorithm"] == "ppo"
    assert run.data.params["ppo.n_steps"] == "32" and run.data.params["num_envs"] == "4"
    assert "charts/sps" in run.data.metrics and run.data.metrics["eval/mean_return"] == result["eval/mean_return"]
    artifacts = {a.path for d in ("plots", "config", "checkpoint") for a in client.list_artifacts(run.info.run_id, d)}
    assert {"plots/learning_curve.png", "config/config.json", "checkpoint/checkpoint.pt"} <= artifacts
    version = client.get_model_version_by_alias("sdk-tracked", "candidate")
    assert version.run_id == run.info.run_id
    trainer.env.close()


def test_sdk_tracked_run_has_the_flow_runs_metrics_and_engine_params():
    """One training entry: ``train(track=True)`` and ``train_flow`` log the same metric names and engine params (the
    flow adds only its probe's random-policy return)."""
    from opentinker import PPOTrainer
    from opentinker.flows.params import TrainParams
    from opentinker.flows.train import run_train_flow

    engine = {"num_envs": 4, "backend": "local", "n_steps": 32, "hidden_sizes": (16,)}
    flow = run_train_flow(
        TrainParams(steps=256, seed=5, engine=engine, run_name="same-flow", model_name="same-flow", eval_episodes=2)
    )
    trainer = PPOTrainer("CartPole-v1", seed=5, **engine)
    trainer.train(256, track=True, run_name="same-sdk", model_name="same-sdk", eval_episodes=2)
    trainer.env.close()
    flow_run, sdk_run = _client().get_run(flow.run_id), _client().get_run(trainer.last_run_id)
    assert set(sdk_run.data.metrics) == set(flow_run.data.metrics) - {"charts/random_policy_return"}
    assert "charts/sps" in sdk_run.data.metrics and "losses/policy" in sdk_run.data.metrics
    for key in ("algorithm", "num_envs", "backend", "ppo.n_steps", "ppo.hidden_sizes"):
        assert sdk_run.data.params[key] == flow_run.data.params[key], key


def test_cli_training_starts_before_its_flow_run_and_keeps_every_metric(tmp_path):
    """``opentinker train`` on an in-process env starts training, in its own process, while Prefect starts; the flow
    adopts it and the metrics logged before its MLflow run existed are all there, at their steps."""
    config = tmp_path / "early.toml"
    config.write_text(
        'num_envs = 4\neval_episodes = 2\nchampion_threshold = 0.0\nmodel_name = "early"\n'
        'run_name = "early"\n[ppo]\nn_steps = 32\n'
    )
    result = CliRunner().invoke(app, ["train", "CartPole-v1", "--steps", "2048", "--config", str(config)])
    assert result.exit_code == 0, result.output
    client = _client()
    run_id = client.get_model_version_by_alias("early", "candidate").run_id
    run = client.get_run(run_id)
    assert run.data.params["backend"] == "local" and run.data.tags["opentinker.rollout_nodes"] == "local"
    steps = [m.step for m in client.get_metric_history(run_id, "charts/sps")]
    assert steps == list(range(128, 2048 + 1, 128))
    workers = json.loads((get_settings().resolved_data_dir / "runs" / "early" / "workers.json").read_text())
    assert workers["pids"] != [os.getpid()]
