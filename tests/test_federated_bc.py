"""Federated behaviour cloning: sites whose `local_data` is an offline transition dataset (validation, the site's
BC step, and a 3-site non-IID run on Flower's simulation engine that must learn CartPole from the datasets alone)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from fixtures.federated import expert_sites, expert_transitions, small_fed_config, train_message
from flwr.app import Context, RecordDict

from opentinker.agents.bc import BCConfig, DatasetError, behaviour_cloning, load_transitions
from opentinker.agents.policies import ActorCritic, policy_spec
from opentinker.federated import task
from opentinker.federated.api import apply_local_data
from opentinker.federated.client_app import build_client_app, from_record
from opentinker.federated.config import FederatedConfigError, SiteConfig
from opentinker.federated.simulation import simulate

CARTPOLE = gym.make("CartPole-v1")
OBS_SPACE, ACTION_SPACE = CARTPOLE.observation_space, CARTPOLE.action_space


@pytest.fixture(scope="module")
def expert():
    return expert_transitions(site_id=1, episodes=1, seed=0)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.pop("actions"), r"missing field\(s\) \['actions'\]"),
        (
            lambda d: d.update(obs=d["obs"][:, :3]),
            r"'obs' rows have shape \(3,\), the observation space expects \(4,\)",
        ),
        (lambda d: d["actions"].__setitem__(5, 2), r"'actions' out of range: values span \[0, 2\].*allows \[0, 1\]"),
        (lambda d: d["obs"].__setitem__((7, 1), np.nan), r"'obs' has a NaN or infinite value \(first at row 7\)"),
        (lambda d: d.update(rewards=d["rewards"][:-1]), r"'rewards' has \d+ rows but 'obs' has \d+"),
        (lambda d: d.update(next_obs=d["next_obs"][:, :2]), r"'next_obs' rows have shape \(2,\)"),
        (lambda d: d.update(returns=d["rewards"]), r"unknown field\(s\) \['returns'\]"),
        (lambda d: d.update(actions=d["actions"] + 0.5), r"'actions' must be whole numbers"),
    ],
)
def test_dataset_errors_name_the_field(expert, change, message):
    data = {key: value.copy() for key, value in expert.items()}
    change(data)
    with pytest.raises(DatasetError, match=message):
        load_transitions(data, OBS_SPACE, ACTION_SPACE)


def test_dataset_from_npz_and_box_actions(expert, tmp_path):
    np.savez(tmp_path / "site.npz", **expert)
    data = load_transitions(tmp_path / "site.npz", OBS_SPACE, ACTION_SPACE)
    assert len(data) == len(expert["obs"]) and data.actions.dtype == np.int64 and data.obs.dtype == np.float32
    with pytest.raises(DatasetError, match="no such file"):
        load_transitions(tmp_path / "missing.npz", OBS_SPACE, ACTION_SPACE)

    # Box actions: bounds are checked, then BC fits the mean (mse) or mean and log_std (nll).
    obs_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = gym.spaces.Box(-2.0, 2.0, (1,), np.float32)
    rng = np.random.default_rng(0)
    obs = rng.uniform(-1, 1, (512, 3)).astype(np.float32)
    actions = np.clip(1.5 * obs[:, :1] - obs[:, 1:2], -2, 2)
    with pytest.raises(DatasetError, match=r"'actions' out of range.*allows \[\[-2.0\], \[2.0\]\]"):
        load_transitions({"obs": obs, "actions": actions * 3}, obs_space, action_space)
    data = load_transitions({"obs": obs, "actions": actions[:, 0]}, obs_space, action_space)  # (N,) for a 1-D action
    for loss in ("mse", "nll"):
        torch_policy = ActorCritic(policy_spec(obs_space, action_space, False, (32, 32), "tanh"))
        log_std = torch_policy.log_std.detach().clone()
        critic = {k: v.clone() for k, v in torch_policy.critic.state_dict().items()}
        first = behaviour_cloning(torch_policy, data, BCConfig(epochs=1, box_loss=loss), rng)
        last = behaviour_cloning(torch_policy, data, BCConfig(epochs=20, box_loss=loss), rng)
        assert last.loss < first.loss * (0.2 if loss == "mse" else 1.0) and last.num_samples == 512
        assert all(np.array_equal(v, torch_policy.critic.state_dict()[k]) for k, v in critic.items())
        assert (torch_policy.log_std.detach() != log_std).any() == (loss == "nll")
    mean = torch_policy.act(obs[:64])
    assert np.mean((mean - actions[:64]) ** 2) < 0.05


def test_local_data_forms(expert, tmp_path):
    site = apply_local_data(SiteConfig(site_id=2), {"dataset": expert, "pole_length": 0.7}, tmp_path / "site-2")
    assert site.pole_length == 0.7 and site.dataset == str((tmp_path / "site-2" / "dataset.npz").resolve())
    np.testing.assert_array_equal(np.load(site.dataset)["obs"], expert["obs"])  # in-memory arrays kept on the site
    np.savez(tmp_path / "own.npz", **expert)
    assert apply_local_data(SiteConfig(), str(tmp_path / "own.npz"), tmp_path / "x").dataset == str(
        (tmp_path / "own.npz").resolve()
    )
    assert apply_local_data(SiteConfig(), {"gravity": 11.0}, tmp_path / "x") == SiteConfig(gravity=11.0)
    with pytest.raises(FederatedConfigError, match="local_data: dataset: missing field"):
        apply_local_data(SiteConfig(), {"obs": expert["obs"]}, tmp_path / "x")
    with pytest.raises(FederatedConfigError, match="unknown key 'episodes'"):
        apply_local_data(SiteConfig(), {"episodes": 3}, tmp_path / "x")


BC_TRAIN = {
    "aggregation-interval": 30.0,
    "bc-epochs": 3,
    "bc-batch-size": 64,
    "bc-learning-rate": 1e-3,
    "bc-box-loss": "mse",
}


def test_dataset_site_trains_the_actor_and_reports_its_sample_count(expert, tmp_path):
    np.savez(tmp_path / "good.npz", **expert)
    bad = dict(expert, actions=expert["actions"] + 1)
    np.savez(tmp_path / "bad.npz", **bad)
    app = build_client_app()
    global_weights = task.get_weights(task.new_trainer("CartPole-v1", task.default_variant(1), seed=0))

    def context(dataset):
        return Context(
            run_id=8,
            node_id=1,
            state=RecordDict(),
            run_config={},
            node_config={"state-dir": str(tmp_path / "state"), "site-id": 1, "dataset": str(dataset)},
        )

    reply = app(train_message(global_weights, run_id=8, config=BC_TRAIN), context(tmp_path / "good.npz"))
    assert not reply.has_error()
    metrics, got = reply.content["metrics"], from_record(reply.content["arrays"])
    assert metrics["num-steps"] == len(expert["obs"]) and metrics["train-loss"] < 0.69
    # A PPO site's reply has the same metric keys: Flower's FedAvg refuses to aggregate mixed key sets.
    ppo_reply = app(train_message(global_weights, run_id=8, config=BC_TRAIN), context(""))
    assert not ppo_reply.has_error() and ppo_reply.content["metrics"]["num-steps"] >= 512
    assert sorted(ppo_reply.content["metrics"]) == sorted(metrics) == sorted(("site-id", *task.TRAIN_METRICS))
    assert any(not np.array_equal(got[k], global_weights[k]) for k in global_weights if k.startswith("actor."))
    assert all(np.array_equal(got[k], global_weights[k]) for k in global_weights if k.startswith("critic."))
    with pytest.raises(DatasetError, match=r"'actions' out of range: values span \[1, 2\]"):
        app(train_message(global_weights, run_id=8, config=BC_TRAIN), context(tmp_path / "bad.npz"))


def test_federated_bc_on_non_iid_datasets_learns_cartpole_on_every_site(ray_session, tmp_path):
    """Three sites, each with expert data from its own physics and a different amount of it; no site runs PPO."""
    sites = expert_sites(tmp_path, episodes=(1, 2, 4), seed=10)
    config = small_fed_config(run_name="sim-bc", num_server_rounds=2, bc_epochs=5, register_as="")
    result = simulate(config, sites)
    assert result.status == "FINISHED" and result.rounds == 2
    first, last = result.history[0], result.history[-1]
    for site in range(3):
        assert last[f"return/site-{site}"] > first[f"return/site-{site}"], (site, first, last)
        assert last[f"return/site-{site}"] > 150, (site, last)
    sizes = [len(np.load(site.dataset)["obs"]) for site in sites]
    assert all(entry["round/train_steps"] == sum(sizes) for entry in result.history[1:])  # FedAvg weights = samples

    # The data-poor site (one episode) does better with the federation than alone with the same local epochs.
    alone = task.new_trainer("CartPole-v1", task.default_variant(0), seed=config.seed)
    data = task.load_site_dataset(sites[0].dataset, alone)
    for _ in range(config.num_server_rounds):
        task.train_bc_local(alone, data, seconds=60.0, config=BCConfig(epochs=config.bc_epochs))
    alone_return = task.evaluate(alone, episodes=config.eval_episodes)
    print(
        f"federated BC returns by round: {[entry['return/mean'] for entry in result.history]}; "
        f"site 0 alone {alone_return:.1f}, federated {last['return/site-0']:.1f}"
    )
    assert last["return/site-0"] > alone_return
