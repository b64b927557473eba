"""The multi-agent Prefect flow: per-kind metrics in one MLflow run, one registered model per kind."""

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # starts real services or trains through a flow

SMALL = dict(n_predators=2, n_prey=3, grid_size=6, max_cycles=12)
FAST_PREY = {"learning_starts": 64, "buffer_size": 512, "batch_size": 32, "train_frequency": 8}


def test_flow_logs_per_kind_metrics_and_registers_one_model_per_kind():
    import mlflow

    from opentinker.agents.export import load_policy
    from opentinker.flows.train import train_flow
    from opentinker.infra.settings import get_settings
    from opentinker.tasks.spec import RunSpec
    from opentinker.tasks.train import run_dir
    from opentinker.tracking import registry as model_store
    from opentinker.tracking.runs import configure_mlflow

    spec = RunSpec(
        env_id="pursuit",
        algorithm="group",
        env_kwargs=SMALL,
        configs={"predator": {"lr": 1e-3}, "prey": FAST_PREY},
        steps=128,
        num_envs=2,
        n_steps=16,
        eval_episodes=2,
        run_name="ma-flow",
        model_name="test-hunt",
        shared_memory=True,
        backend="local",
        workers=2,
    )  # two in-process shards
    result = train_flow(spec)
    assert result.global_step == 128 and set(result.models) == {"predator", "prey"}
    assert len(result.evaluation["prey"].returns) == 2 * SMALL["n_prey"]

    configure_mlflow()
    client = mlflow.MlflowClient()
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["backend"] == "local" and run.data.params["workers"] == "2"
    for name in (
        "predator/losses/policy",
        "prey/losses/td_loss",
        "prey/charts/epsilon",
        "charts/agent_steps_per_s",
        "eval/prey/mean_length",
        "eval/predator/mean",
    ):
        assert name in run.data.metrics, name
    assert [m.step for m in client.get_metric_history(result.run_id, "charts/sps")] == [32, 64, 96, 128]

    for kind, ref in result.models.items():
        assert ref.name == f"test-hunt-{kind}" and "candidate" in ref.aliases
        served = model_store.load_registered_policy(f"models:/test-hunt-{kind}@candidate")
        assert served.spec["metadata"]["kind"] == kind and served.spec["metadata"]["shared_memory"] == "all"
        obs = np.random.default_rng(0).uniform(-1, 1, (16, *served.observation_space.shape)).astype(np.float32)
        local = load_policy(run_dir(get_settings().resolved_data_dir, "ma-flow") / "export" / kind)
        np.testing.assert_array_equal(served.act(obs), local.act(obs))
