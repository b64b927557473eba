"""Data-parallel learners (agents/learners.py) on local Ray over loopback gloo: 2 learners give the update of 1 (PPO,
DQN), a learner killed mid-run costs nothing but time, and a 2-learner train_flow registers a working model."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from opentinker.agents import DQN, PPO, SAC, TD3
from opentinker.agents.learners import learner_gpus

# 2 learners sum two row-weighted half-minibatch gradients where 1 learner sums all rows at once: the same terms in
# another order, so float32 rounding differs by a few ulps (~1e-7 relative) per gradient. Adam's first steps move
# each weight by about lr * g / (|g| + eps); a ulp-level change in g moves that by far less than 1e-5 after the
# handful of steps here (measured: 3e-8 PPO, 1.5e-8 DQN), while a wrong reduction (sum instead of mean, a missing slice)
# moves weights by ~lr = 2.5e-4.
ATOL = 1e-5
THRESHOLD = 100.0
"""Champion gate of the 2-learner flow: an untrained MLP's greedy policy keeps CartPole up for ~10-40 steps; this
seeded run's model holds it for ~200 after 2,048 steps."""

PPO_SMALL = dict(num_envs=8, n_steps=32, num_minibatches=2, update_epochs=2, backend="local", total_steps=4096)
DQN_SMALL = dict(num_envs=4, n_steps=32, learning_starts=0, train_frequency=16, batch_size=64, backend="local")


def weight_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize(
    "trainer_cls, config, steps, loss_key",
    [
        (PPO, PPO_SMALL, 256, "losses/policy"),  # one iteration: 2 epochs x 2 minibatches of 128 rows
        (DQN, dict(DQN_SMALL, total_steps=4096), 128, "losses/td_loss"),  # one iteration: 8 steps of 64 rows
    ],
)
@pytest.mark.slow  # a Ray gang of learner processes
def test_two_learners_give_the_update_of_one(ray_session, trainer_cls, config, steps, loss_key):
    """One iteration of ``train`` (same seed, so the same first rollout) with 1 and with 2 learners."""
    single = trainer_cls("CartPole-v1", seed=3, **config)
    pair = trainer_cls("CartPole-v1", seed=3, num_learners=2, **config)
    before = {k: v.clone() for k, v in single.policy.state_dict().items()}
    single_metrics, metrics = single.train(steps), pair.train(steps)
    gap = weight_gap(single.policy.state_dict(), pair.policy.state_dict())
    assert gap <= ATOL, f"2 learners vs 1: max weight gap {gap:.2e}"
    assert weight_gap(before, pair.policy.state_dict()) > 100 * ATOL  # the update did move the weights
    assert pair.global_step == single.global_step == steps and pair.learners is None
    assert metrics[loss_key] == pytest.approx(single_metrics[loss_key], rel=1e-4, abs=1e-6)
    # One flat float32 gradient buffer per optimiser step, plus the statistics: PPO's 5 with every step (4 steps),
    # DQN's 2 once per iteration (8 steps).
    params = sum(p.numel() for p in single.params)
    expected = 4 * (params + 5) * 4 if trainer_cls is PPO else 4 * (params * 8 + 2)
    assert metrics["perf/allreduce_bytes"] == expected
    assert metrics["perf/allreduce_ms"] > 0
    if trainer_cls is DQN:  # the trainer took learner 0's whole state, replay buffer included
        assert len(pair.buffer) == len(single.buffer) > 0


OFF_POLICY_SMALL = dict(
    num_envs=2, n_steps=32, learning_starts=0, train_frequency=8, batch_size=64, hidden_sizes=(32, 32), backend="local"
)


@pytest.mark.slow  # a Ray gang of learner processes
@pytest.mark.parametrize("trainer_cls", [SAC, TD3])
def test_two_learners_give_the_off_policy_update_of_one(ray_session, trainer_cls):
    """One iteration (64 env steps, 8 gradient steps of 64 rows): both learners store the rollout, draw the same
    batches and noise, and each computes its half of every batch's gradients for critics, actor (and temperature)."""
    # fp32 (their default is bf16 where native): sums over half batches round differently in bf16 products
    single = trainer_cls("Pendulum-v1", seed=3, amp_mode="off", **OFF_POLICY_SMALL)
    pair = trainer_cls("Pendulum-v1", seed=3, amp_mode="off", num_learners=2, **OFF_POLICY_SMALL)
    before = {k: v.clone() for k, v in single.critic.state_dict().items()}
    single_metrics, metrics = single.train(64), pair.train(64)
    for name in ("policy", "critic", "critic_target"):
        gap = weight_gap(getattr(single, name).state_dict(), getattr(pair, name).state_dict())
        assert gap <= ATOL, f"2 learners vs 1: {name} max weight gap {gap:.2e}"
    assert weight_gap(before, pair.critic.state_dict()) > 100 * ATOL
    assert metrics["losses/critic"] == pytest.approx(single_metrics["losses/critic"], rel=1e-4)
    assert metrics["perf/allreduce_bytes"] > 0 and len(pair.buffer) == len(single.buffer) == 64


@pytest.mark.slow  # a Ray gang of learner processes
def test_killed_learner_restarts_from_checkpoint_with_the_same_weights(ray_session, tmp_path):
    """A PPO run with 2 learners trains; a copy whose learner 1 is killed between two checkpoints replays from the
    last one (env, RNG and learner-0 state) and ends bit-identical."""
    reference = PPO("CartPole-v1", seed=5, num_learners=2, **PPO_SMALL)
    history = []
    reference.train(
        1024, callback=lambda m, s: history.append(m), checkpoint_dir=tmp_path / "ref", checkpoint_every=512
    )
    assert len(history) == 4 and all(m["perf/allreduce_bytes"] > 0 for m in history)
    assert history[-1]["charts/episodic_return_mean"] > history[0]["charts/episodic_return_mean"]

    trainer = PPO("CartPole-v1", seed=5, num_learners=2, **PPO_SMALL)
    killed: list[int] = []

    def kill_once(metrics: dict, step: int) -> None:
        if step == 768 and not killed:  # after the checkpoint at 512: iterations from 512 on are replayed
            killed.append(trainer.learners.pids()[1])
            os.kill(killed[0], signal.SIGKILL)

    trainer.train(1024, callback=kill_once, checkpoint_dir=tmp_path / "killed", checkpoint_every=512)
    assert killed and trainer.global_step == reference.global_step == 1024
    for name, value in reference.policy.state_dict().items():
        assert torch.equal(value, trainer.policy.state_dict()[name]), name


@pytest.mark.slow
def test_train_flow_with_two_learners_registers_a_model_that_passes_evaluation(ray_session):
    import mlflow
    from fixtures.pipeline import small_train_params

    from opentinker.flows.train import train_flow
    from opentinker.infra.settings import get_settings

    params = small_train_params(
        steps=2048,
        backend="local",  # envs in-process: the learners are the only actors this run starts
        workers=None,
        run_name="two-learners",
        model_name="test-two-learners",
        champion_threshold=THRESHOLD,
        ppo={"n_steps": 128, "num_learners": 2},
    )
    result = train_flow(params)
    client = mlflow.MlflowClient(get_settings().tracking_uri)
    run = client.get_run(result.run_id)
    assert run.data.params["ppo.num_learners"] == "2"
    assert run.data.metrics["perf/allreduce_bytes"] > 0 and "perf/allreduce_ms" in run.data.metrics
    champion = client.get_model_version_by_alias(result.model_name, "champion")
    assert str(champion.version) == result.model_version and result.eval_mean >= THRESHOLD


def test_num_learners_is_checked_and_refused_in_agent_groups():
    from opentinker.multiagent import AgentGroup

    with pytest.raises(ValueError, match="num_learners must be an int >= 1, got 0"):
        PPO("CartPole-v1", num_learners=0, backend="local")
    with pytest.raises(ValueError, match=r"configure\(prey=...\): num_learners must be 1 in an agent group"):
        AgentGroup(policy_mapping={"predator": "PPO", "prey": "DQN"}).configure(prey={"num_learners": 2})


def test_learner_gpu_placement():
    assert learner_gpus("cpu", 4, 8.0) == (0.0, "gloo")
    assert learner_gpus("cuda", 2, 2.0) == (1.0, "nccl")  # a GPU each
    assert learner_gpus("cuda", 2, 1.0) == (0.5, "gloo")  # NCCL refuses two ranks on one GPU
    assert learner_gpus("cuda", 4, 3.0) == (0.5, "gloo")  # 0.75 each would leave the 4th learner pending
    with pytest.raises(ValueError, match="num_learners=2 on device cuda: the Ray cluster has no GPU"):
        learner_gpus("cuda", 2, 0.0)
