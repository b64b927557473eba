"""train_flow end to end on real Ray, MLflow (session SQLite store) and Prefect (local mode); cache, resume, gate."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlflow
import numpy as np
import pytest
from fixtures.pipeline import RUN_ARTIFACTS

from opentinker.infra.settings import get_settings

pytestmark = pytest.mark.slow


def _client() -> mlflow.MlflowClient:
    return mlflow.MlflowClient(get_settings().tracking_uri)


def test_train_flow_tracks_metrics_artifacts_and_registers(cartpole_run):
    params, result = cartpole_run
    client = _client()
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["env_id"] == "CartPole-v1" and run.data.params["ppo.n_steps"] == "128"
    assert run.data.tags["prefect.flow_run_id"]
    assert run.data.tags["opentinker.dashboard_remedies"]  # "none", or the remedy for each missed target
    for key in (
        "charts/episodic_return_mean",
        "charts/sps",
        "losses/value",
        "perf/cpu_percent",
        "perf/rollout_efficiency",
        "eval/mean_return",
    ):
        assert key in run.data.metrics, key
    sps = client.get_metric_history(result.run_id, "charts/sps")
    steps = [m.step for m in sps]
    assert steps == sorted(steps) and len(steps) >= 4 and steps[-1] == result.global_step >= params.steps

    artifacts = {
        a.path for d in ("", "plots", "config", "checkpoint") for a in client.list_artifacts(result.run_id, d or None)
    }
    assert RUN_ARTIFACTS <= artifacts
    card = Path(mlflow.artifacts.download_artifacts(run_id=result.run_id, artifact_path="model_card.md")).read_text()
    assert f"{result.eval_mean:.2f}" in card and "CartPole-v1" in card

    candidate = client.get_model_version_by_alias(result.model_name, "candidate")
    champion = client.get_model_version_by_alias(result.model_name, "champion")  # threshold 0: first champion
    assert str(candidate.version) == str(champion.version) == result.model_version
    assert candidate.run_id == result.run_id
    assert candidate.tags["gate.decision"].startswith("promoted") and float(
        candidate.tags["eval.mean"]
    ) == pytest.approx(result.eval_mean, abs=1e-3)
    assert champion.description.startswith("Release gate: promoted")
    model = client.get_logged_model(champion.source.removeprefix("models:/"))  # eval metrics show on the model's page
    assert {"eval/mean_return", "eval/std_return"} <= {metric.key for metric in model.metrics}
    assert "None" not in run.data.params.values() and run.data.tags["mlflow.user"]
    assert run.data.tags["mlflow.source.name"] == "opentinker train flow"
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"

    pyfunc = mlflow.pyfunc.load_model(f"models:/{result.model_name}@champion")
    actions = np.asarray(pyfunc.predict(np.zeros((3, 4), dtype=np.float32)))
    assert actions.shape[0] == 3 and set(actions.tolist()) <= {0, 1}


def test_evaluation_is_cached_per_model_version_and_seeds(cartpole_run):
    from opentinker.flows.params import EvalParams
    from opentinker.flows.release import evaluate_flow

    _, result = cartpole_run
    params = EvalParams(model_uri=f"models:/{result.model_name}/{result.model_version}", episodes=2, seed=77)
    first, second = evaluate_flow(params), evaluate_flow(params)
    assert (first.cached, second.cached) == (False, True)
    assert second.returns == first.returns and second.model_key == f"{result.model_name}/{result.model_version}"
    other_seeds = evaluate_flow(params.model_copy(update={"seed": 78}))
    assert other_seeds.cached is False


def test_resume_continues_from_the_last_checkpoint(cartpole_run):
    from opentinker.flows.train import train_flow

    params, first = cartpole_run
    resumed = train_flow(params.model_copy(update={"steps": first.global_step + 1024, "resume": True}))
    assert resumed.start_step == first.global_step
    assert resumed.global_step >= first.global_step + 1024
    assert resumed.run_id != first.run_id  # one MLflow run per flow run ...
    steps = [m.step for m in _client().get_metric_history(resumed.run_id, "charts/sps")]
    assert steps and min(steps) > first.global_step  # ... logged against the global env step, so curves line up


def _register_export(export_dir: Path, model_name: str) -> str:
    from opentinker.tasks.register import register_model

    client = _client()
    experiment_id = client.get_experiment_by_name(get_settings().mlflow_experiment).experiment_id
    run_id = client.create_run(experiment_id).info.run_id
    version = register_model(run_id, str(export_dir), model_name).version
    client.set_terminated(run_id)
    return version


def _hand_made_policy(source: Path, target: Path, balance: bool) -> Path:
    """An MLP export whose greedy action is ``3θ + θ' > 0`` (balances CartPole: 500) or always 0 (falls: ~9)."""
    shutil.copytree(source, target)
    weights = dict(np.load(source / "weights.npz"))
    actor = sorted(
        (k for k in weights if k.startswith("actor.") and k.endswith(".weight")), key=lambda k: int(k.split(".")[1])
    )
    for key in weights:
        weights[key] = np.zeros_like(weights[key])
    if balance:
        weights[actor[0]][0, 2], weights[actor[0]][0, 3] = 3.0, 1.0
        for key in actor[1:-1]:
            weights[key][0, 0] = 1.0
        weights[actor[-1]][1, 0] = 10.0
    np.savez(target / "weights.npz", **weights)
    return target


def test_promotion_gate_moves_champion_only_on_a_strict_win(cartpole_run, tmp_path):
    from opentinker.flows.release import release_flow
    from opentinker.tasks.train import run_dir

    params, _ = cartpole_run
    export = run_dir(get_settings().resolved_data_dir, params.resolved_run_name) / "export"
    name = "gate-test"
    good = _hand_made_policy(export, tmp_path / "good", balance=True)
    bad = _hand_made_policy(export, tmp_path / "bad", balance=False)

    first = release_flow(name, _register_export(good, name), episodes=3, threshold=100.0)
    assert "champion" in first.aliases, first.decision
    client = _client()
    for candidate_dir, outcome in ((good, "tie"), (bad, "loss")):
        version = _register_export(candidate_dir, name)
        released = release_flow(name, version, episodes=3, threshold=0.0)
        assert "champion" not in released.aliases, outcome
        assert str(client.get_model_version_by_alias(name, "champion").version) == first.version, outcome
        tags = client.get_model_version(name, version).tags
        assert tags["gate.promoted"] == "false" and tags["gate.champion_version"] == first.version
        assert float(tags["gate.champion_mean"]) == 500.0
        assert tags["gate.decision"].startswith("kept champion")
