"""What a stochastic policy serves: its greedy action, unless sampling clearly beats it; evaluation reports both, the
choice is recorded in the export, and serving, later evaluations and the promotion gate follow it (issue 37)."""

from __future__ import annotations

import dataclasses

import mlflow
import numpy as np
import pytest

from opentinker.agents.evaluation import EvalResult, choose_served
from opentinker.agents.export import export_policy, load_policy, record_served_action
from opentinker.agents.ppo import PPO
from opentinker.infra.settings import get_settings

RPS = "opentinker.envs.games:RockPaperScissorsEnv"
IDENTITY = "opentinker.envs.identity:MultiBinaryIdentityEnv"


def _evaluation(greedy: list[float], sampled: list[float]) -> EvalResult:
    return dataclasses.replace(
        EvalResult.of(greedy, seed=0), alternative=EvalResult.of(sampled, seed=0, action="sampled")
    )


def test_sampling_is_served_only_where_it_clearly_beats_greedy():
    assert choose_served(_evaluation([1.0, 1.0], [1.0, 1.0])).action == "greedy"  # a tie keeps the greedy action
    assert choose_served(_evaluation([0.0, 2.0, 0.0, 2.0], [2.0, 0.0, 2.0, 1.0])).action == "greedy"  # within noise
    served = choose_served(_evaluation([-20.0, -19.0, -20.0], [1.0, -2.0, 0.0]))
    assert (served.action, served.mean, served.alternative.action, served.alternative.mean) == (
        "sampled",
        pytest.approx(-1 / 3),
        "greedy",
        pytest.approx(-59 / 3),
    )
    assert (served.mean_of("greedy"), served.mean_of("sampled")) == (served.alternative.mean, served.mean)
    only_greedy = choose_served(EvalResult.of([3.0, 4.0], seed=0))  # a policy with no distribution to sample
    assert only_greedy.action == "greedy" and only_greedy.mean_of("sampled") is None


def test_an_export_serves_the_action_it_records(tmp_path):
    """An untrained policy on rock-paper-scissors: greedy answers one move for its one observation, and the same
    export recorded as ``sampled`` answers all three (through the policy service's own loading too)."""
    from opentinker.serving.model_slot import load_served_model

    trainer = PPO(RPS, num_envs=2, backend="local", device="cpu")
    trainer.env.close()
    directory = export_policy(trainer, tmp_path / "export")
    obs = np.ones((300, 1), np.float32)
    assert load_policy(directory).served_action == "greedy" and len(set(load_policy(directory).act(obs))) == 1
    evaluated = load_policy(directory).evaluate(RPS, episodes=10, seed=3)
    assert evaluated.action == "greedy" and evaluated.alternative.action == "sampled"
    assert evaluated == load_policy(directory).evaluate(RPS, episodes=10, seed=3)  # sampled reproducibly

    record_served_action(directory, "sampled")
    for policy in (load_policy(directory), load_served_model(str(directory)).policy):
        assert policy.served_action == "sampled"
        assert set(policy.act(obs)) == {0, 1, 2} and set(policy.act_with_info(obs)[0]) == {0, 1, 2}
    again = load_policy(directory).evaluate(RPS, episodes=10, seed=3)
    assert (again.action, again.returns, again.alternative.returns) == (
        "sampled",
        evaluated.alternative.returns,
        evaluated.returns,
    )
    with pytest.raises(ValueError, match="served action"):
        record_served_action(directory, "argmax")


@pytest.mark.slow
def test_the_gate_judges_and_serves_the_sampled_policy_where_greedy_loses():
    """Rock-paper-scissors against an opponent that counters the player's favourite move: the greedy action loses
    every round, sampling breaks even. The flow reports both, registers the model as serving sampled actions, the
    gate passes it on that figure (greedy alone would fail the threshold), and the champion acts at random; an
    identity env, where greedy wins, stays greedy."""
    from opentinker.flows.params import EvalParams
    from opentinker.flows.release import evaluate_flow
    from opentinker.flows.train import train_flow
    from opentinker.tasks.spec import RunSpec
    from opentinker.tracking.registry import load_registered_policy

    common = dict(steps=4096, seed=1, backend="local", eval_episodes=20)
    rps = train_flow(RunSpec(env_id=RPS, champion_threshold=-8.0, model_name="served-rps", **common))
    assert (rps.eval_action, rps.eval_mean) == ("sampled", rps.eval_sampled_mean)
    assert rps.eval_greedy_mean < -8.0 <= rps.eval_mean and "champion" in rps.aliases, rps
    assert "sampled actions" in rps.decision

    client = mlflow.MlflowClient(get_settings().tracking_uri)
    version = client.get_model_version(rps.model_name, rps.model_version)
    assert version.tags["eval.action"] == version.tags["gate.candidate_action"] == "sampled"
    assert float(version.tags["eval.greedy_mean"]) == pytest.approx(rps.eval_greedy_mean, abs=1e-3)
    assert client.get_run(rps.run_id).data.tags["gate.candidate_action"] == "sampled"
    champion = load_registered_policy(f"models:/{rps.model_name}@champion")
    assert champion.served_action == "sampled" and set(champion.act(np.ones((300, 1), np.float32))) == {0, 1, 2}
    again = evaluate_flow(EvalParams(model_uri=f"models:/{rps.model_name}@champion", episodes=20))
    assert again.action == "sampled" and again.mean == pytest.approx(rps.eval_mean)  # the same seeds, the same draws

    identity = train_flow(RunSpec(env_id=IDENTITY, champion_threshold=0.0, model_name="served-identity", **common))
    assert identity.eval_action == "greedy" and identity.eval_mean > identity.eval_sampled_mean, identity
    assert load_registered_policy(f"models:/{identity.model_name}@champion").served_action == "greedy"


@pytest.mark.slow
def test_a_server_job_is_gated_and_served_on_what_its_child_measured(tmp_path):
    """The job path: the sandboxed child reports both actions' returns (``job_child.evaluation``), the trusted side
    chooses the served action from them, records it in the export it registers and gates on it."""
    from opentinker.flows.presets import resolve_spec
    from opentinker.server.channel import PolicyResult
    from opentinker.server.finish import finish_policy
    from opentinker.server.job_child import evaluation
    from opentinker.tasks.run import tracked_run
    from opentinker.tasks.spec import RunSpec
    from opentinker.tracking.registry import load_registered_policy
    from opentinker.tracking.runs import MetricsLogger

    spec = resolve_spec(
        RunSpec(env_id=RPS, steps=512, backend="local", champion_threshold=-8.0, model_name="served-rps-job")
    )
    trainer = PPO(RPS, num_envs=2, backend="local", device="cpu")  # untrained: near-uniform, its greedy move fixed
    trainer.save(tmp_path / "checkpoints" / "checkpoint.pt")
    trainer.env.close()
    export_policy(trainer, tmp_path / "export", metadata={"env_id": RPS})
    measured = load_policy(tmp_path / "export").evaluate(RPS, 20, spec.eval_seed)  # what the child measures
    result = PolicyResult(
        start_step=0,
        global_step=512,
        train_seconds=1.0,
        evaluation=evaluation(measured),
        threshold=spec.champion_threshold,
    )
    logger = MetricsLogger.with_progress(None, spec.steps, system=False)
    with tracked_run(spec.config_form(), spec.resolved_run_name, spec.experiment) as run:
        logger.run_id = run.run_id
        outcome = finish_policy(spec, run, result, tmp_path, logger, None)
    assert (outcome.eval_action, outcome.eval_mean) == ("sampled", pytest.approx(measured.alternative.mean))
    assert measured.mean < -8.0 <= outcome.eval_mean and "champion" in outcome.aliases, outcome
    assert load_registered_policy(f"models:/{outcome.model_name}@champion").served_action == "sampled"
