"""AgentGroup: mapping/config errors, kind layout, shared memory, checkpoint/resume and per-kind exports."""

import numpy as np
import pytest
import torch

from opentinker.agents.export import load_policy
from opentinker.agents.multiagent import AgentGroup, GroupTrainer
from opentinker.envs.pursuit import PursuitEnv

SMALL = dict(n_predators=2, n_prey=3, grid_size=6, max_cycles=12)
FAST = {
    "prey": {
        "learning_starts": 64,
        "buffer_size": 512,
        "batch_size": 32,
        "train_frequency": 8,
        "target_network_frequency": 64,
    }
}


def seed_group(shared_memory=False):
    return AgentGroup(policy_mapping={"predator": "PPO", "prey": "DQN"}, shared_memory=shared_memory).configure(**FAST)


# -- mapping and configuration errors ----------------------------------------------------------------------------
def test_unknown_algorithm_is_named():
    with pytest.raises(ValueError, match=r"policy_mapping\['prey'\]: unknown algorithm 'A3C'.*\['DQN', 'PPO'\]"):
        AgentGroup(policy_mapping={"predator": "PPO", "prey": "A3C"})


def test_unknown_kind_in_configure_is_named():
    group = AgentGroup(policy_mapping={"predator": "PPO", "prey": "DQN"})
    with pytest.raises(
        ValueError, match=r"configure: unknown kind 'wolf'; kinds in policy_mapping: \['predator', 'prey'\]"
    ):
        group.configure(wolf={"lr": 1e-3})


def test_configure_checks_fields_values_and_group_settings():
    group = AgentGroup(policy_mapping={"predator": "PPO", "prey": "DQN"})
    group.configure(predator={"lr": 3e-4, "gamma": 0.99}, prey={"epsilon_decay": 0.995})
    assert group.configs["predator"] == {"learning_rate": 3e-4, "gamma": 0.99}
    with pytest.raises(ValueError, match="unknown PPO hyper-parameter 'epsilon_decay'"):
        group.configure(predator={"epsilon_decay": 0.9})  # a DQN-only knob on a PPO kind
    with pytest.raises(ValueError, match="gamma must be in"):
        group.configure(predator={"gamma": 1.5})
    with pytest.raises(ValueError, match="buffer_size must be >= batch_size"):
        group.configure(prey={"buffer_size": 16})
    with pytest.raises(ValueError, match="epsilon_decay must be in"):
        group.configure(prey={"epsilon_decay": 1.2})
    with pytest.raises(ValueError, match="'n_steps' is shared by the whole group"):
        group.configure(prey={"n_steps": 8})
    assert group.configs["predator"] == {"learning_rate": 3e-4, "gamma": 0.99}  # failed calls change nothing


def test_agents_without_a_kind_and_kinds_without_agents_are_named():
    with pytest.raises(ValueError, match="agent 'predator_0' matches no kind"):
        AgentGroup({"hunter": "PPO", "prey": "DQN"}).build("pursuit", **SMALL)
    with pytest.raises(ValueError, match=r"kind\(s\) \['wolf'\] of policy_mapping match no agent"):
        AgentGroup({"predator": "PPO", "prey": "DQN", "wolf": "PPO"}).build("pursuit", **SMALL)
    with pytest.raises(ValueError, match="shared_memory must be one of"):
        AgentGroup({"predator": "PPO"}, shared_memory="yes")


def test_mapping_function_and_prefixes_share_one_network_per_kind():
    by_function = AgentGroup(
        {"hunters": "PPO", "runners": "PPO"},
        agent_to_kind=lambda a: "hunters" if a.startswith("predator") else "runners",
    )
    trainer = by_function.build("pursuit", num_envs=2, device="cpu", **SMALL)
    assert trainer.joint.agents == {"hunters": ["predator_0", "predator_1"], "runners": ["prey_0", "prey_1", "prey_2"]}
    assert trainer.trainers["runners"].config.num_envs == 2 * 3  # columns: env copies x agents, one shared network
    with pytest.raises(ValueError, match=r"unknown kind\(s\) \['wolf'\]"):
        trainer.freeze("wolf")
    with pytest.raises(RuntimeError, match=r"built from EnvSpaces .* cannot train"):
        trainer.trainers["runners"].train(64)  # a kind's rollouts come from its group


# -- shared memory ---------------------------------------------------------------------------------------------
def test_shared_memory_appends_previous_step_means():
    plain = seed_group().build("pursuit", device="cpu", **SMALL)
    shared = seed_group(shared_memory=True).build("pursuit", device="cpu", **SMALL)
    kind_only = seed_group(shared_memory="kind").build("pursuit", device="cpu", **SMALL)
    d = plain.joint.observation_spaces["prey"].shape[0]
    assert shared.joint.observation_spaces["prey"].shape == (3 * d,)  # own obs + predators' mean + prey's mean
    assert kind_only.joint.observation_spaces["prey"].shape == (2 * d,)
    joint = shared.joint
    assert not joint.observations("prey")[:, d:].any()  # nothing written yet after a reset
    before = {k: joint.obs[k][0].copy() for k in joint.kinds}
    joint.step({"predator": np.zeros(2, np.int64), "prey": np.zeros(3, np.int64)})
    obs = joint.observations("prey")
    alive = joint.alive["prey"][0]
    np.testing.assert_allclose(obs[alive][:, d : 2 * d], np.broadcast_to(before["predator"].mean(0), (alive.sum(), d)))
    np.testing.assert_allclose(
        obs[alive][:, 2 * d :], np.broadcast_to(before["prey"].mean(0), (alive.sum(), d)), atol=1e-6
    )


# -- training plumbing, checkpoint/resume, export ------------------------------------------------------------------
def weights(trainer):
    return {k: [p.detach().clone() for p in t.policy.parameters()] for k, t in trainer.trainers.items()}


def test_every_kind_trains_with_its_own_algorithm_and_frozen_kinds_do_not(tmp_path):
    trainer = seed_group().build("pursuit", num_envs=2, n_steps=16, device="cpu", **SMALL)
    start = weights(trainer)
    seen = []
    metrics = trainer.train(96, callback=lambda m, s: seen.append(s))
    assert seen == [32, 64, 96] and trainer.global_step == 96
    assert "predator/losses/approx_kl" in metrics and "prey/losses/td_loss" in metrics
    assert trainer.trainers["prey"].global_step == 96 * 3 and trainer.trainers["predator"].global_step == 96 * 2
    for kind in trainer.trainers:
        assert any(not torch.equal(a, b) for a, b in zip(start[kind], weights(trainer)[kind]))
    trainer.freeze("predator")
    frozen = weights(trainer)["predator"]
    trainer.train(128)
    assert all(torch.equal(a, b) for a, b in zip(frozen, weights(trainer)["predator"]))


def test_checkpoint_resume_is_bit_exact(tmp_path):
    group = AgentGroup({"predator": "PPO", "prey": "DQN"}, shared_memory=True).configure(
        predator={"lr": 3e-4, "gamma": 0.99}, prey={"epsilon_decay": 0.95, **FAST["prey"]}
    )
    trainer = group.build("pursuit", num_envs=2, n_steps=16, seed=3, device="cpu", **SMALL)
    trainer.train(64, checkpoint_dir=tmp_path)
    trainer.train(128)
    resumed = GroupTrainer.load(tmp_path / "checkpoint.pt", device="cpu")
    assert resumed.global_step == 64 and resumed.trainers["prey"].config.epsilon_decay == 0.95
    resumed.train(128)
    for kind, params in weights(trainer).items():
        for a, b in zip(params, weights(resumed)[kind]):
            assert torch.equal(a, b), kind
    assert len(resumed.trainers["prey"].buffer) == len(trainer.trainers["prey"].buffer)


def test_export_one_policy_per_kind_and_evaluate(tmp_path):
    trainer = seed_group(shared_memory=True).build("pursuit", num_envs=2, n_steps=16, device="cpu", **SMALL)
    trainer.train(32)
    paths = trainer.export(tmp_path, metadata={"run": "t"})
    for kind, path in paths.items():
        policy = load_policy(path)
        assert policy.spec["metadata"]["kind"] == kind and policy.spec["metadata"]["shared_memory"] == "all"
        obs = trainer.joint.observations(kind)
        np.testing.assert_array_equal(policy.act(obs), trainer.policies()[kind].act(obs))
    results = trainer.evaluate(episodes=3)
    assert set(results) == {"predator", "prey"}
    assert len(results["prey"].returns) == 3 * 3 and len(results["predator"].returns) == 3 * 2
    assert 1 <= results["prey"].mean_length <= SMALL["max_cycles"]


def test_any_parallel_env_instance_is_accepted():
    trainer = AgentGroup({"predator": "DQN", "prey": "PPO"}).build(
        PursuitEnv(n_predators=1, n_prey=1), num_envs=2, n_steps=8, device="cpu"
    )
    trainer.train(16)
    assert trainer.global_step == 16


# -- rollouts on Ray workers ------------------------------------------------------------------------------------
ROLLOUT_FIELDS = (
    "obs",
    "actions",
    "logprobs",
    "values",
    "rewards",
    "terminated",
    "truncated",
    "valid",
    "last_obs",
    "last_values",
    "episode_returns",
    "episode_lengths",
)


def assert_same_rollouts(a, b):
    (rollouts_a, fraction_a), (rollouts_b, fraction_b) = a, b
    assert rollouts_a.keys() == rollouts_b.keys()
    for kind in rollouts_a:
        for field in ROLLOUT_FIELDS:
            x, y = getattr(rollouts_a[kind], field), getattr(rollouts_b[kind], field)
            assert x.dtype == y.dtype and np.array_equal(x, y), (kind, field)
    np.testing.assert_array_equal([fraction_a[k] for k in fraction_a], [fraction_b[k] for k in fraction_a])


@pytest.mark.slow  # joint envs on Ray actors
def test_ray_workers_give_the_local_rollouts_and_checkpoints_move_between_backends(ray_session, tmp_path):
    import os
    import signal

    build = dict(num_envs=5, n_steps=16, seed=4, device="cpu", **SMALL)
    local = seed_group(shared_memory=True).build("pursuit", backend="local", **build)
    remote = seed_group(shared_memory=True).build("pursuit", backend="ray", workers=2, **build)
    try:
        assert remote.sizes == [3, 2] and os.getpid() not in remote.envs.worker_pids()  # copies 0-2 and 3-4
        local.train(80)
        remote.train(80, checkpoint_dir=tmp_path)  # the env copies' state comes back from the actors
        resumed = GroupTrainer.load(tmp_path / "checkpoint.pt", device="cpu", backend="local")
        assert resumed.backend == "local" and resumed.workers == 1 and resumed.global_step == 80
        expected = local.collect()
        assert_same_rollouts(expected, remote.collect())
        assert_same_rollouts(expected, resumed.collect())
        for trainer in (local, remote, resumed):
            trainer.train(160)
        for kind, params in weights(local).items():
            for other in (remote, resumed):
                assert all(torch.equal(a, b) for a, b in zip(params, weights(other)[kind])), kind
        victim = remote.envs.worker_pids()[1]
        os.kill(victim, signal.SIGKILL)  # Ray restarts the actor; it restores its shard from the last snapshot
        assert_same_rollouts(local.collect(), remote.collect())
        assert victim not in remote.envs.worker_pids()
    finally:
        remote.close()
    with pytest.raises(ValueError, match=r"GroupTrainer workers must be an int in \[1, num_envs=5\], got 6"):
        seed_group().build("pursuit", backend="ray", workers=6, **build)
    with pytest.raises(ValueError, match="GroupTrainer backend must be one of"):
        seed_group().build("pursuit", backend="dask", **build)
