"""The pursuit env: PettingZoo Parallel API conformance, capture rules, observations, episode ends."""

import warnings

import numpy as np
import pytest
from pettingzoo.test import parallel_api_test, parallel_seed_test

from opentinker.envs.pursuit import PursuitEnv, parallel_env

STAY, UP, DOWN, LEFT, RIGHT = range(5)


@pytest.mark.parametrize("config", [{}, {"n_predators": 25, "n_prey": 25, "grid_size": 30, "observe_allies": 0}])
def test_parallel_api_conformance(config):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the API test reports problems as warnings
        parallel_api_test(PursuitEnv(**config), num_cycles=300)


def test_seeded_resets_are_reproducible():
    parallel_seed_test(lambda: parallel_env(n_predators=3, n_prey=2))


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="n_prey"):
        PursuitEnv(n_prey=0)
    with pytest.raises(ValueError, match="grid_sise"):
        PursuitEnv(grid_sise=5)


def _place(env, predators, prey):
    env.reset(seed=0)
    env.pred_pos = np.array(predators, np.int64)
    env.prey_pos = np.array(prey, np.int64)


def test_capture_rewards_removes_prey_and_shares_credit():
    env = PursuitEnv(n_predators=2, n_prey=2, grid_size=10, capture_radius=0, survive_reward=0.5)
    _place(env, [[2, 2], [2, 4]], [[2, 3], [8, 8]])
    # Both predators step onto prey_0's cell; prey_1 stays far away.
    obs, rew, term, trunc, _ = env.step({"predator_0": UP, "predator_1": DOWN, "prey_0": STAY, "prey_1": STAY})
    assert rew["predator_0"] == rew["predator_1"] == 0.5
    assert rew["prey_0"] == -1.0 and term["prey_0"] and rew["prey_1"] == 0.5 and not term["prey_1"]
    assert "prey_0" in obs and "prey_0" not in env.agents and "prey_1" in env.agents
    # The last prey caught ends the episode for everyone (terminated, not truncated).
    env.pred_pos = np.array([[8, 7], [0, 0]])
    obs, rew, term, trunc, _ = env.step({"predator_0": UP, "predator_1": STAY, "prey_1": STAY})
    assert term == {"predator_0": True, "predator_1": True, "prey_1": True} and not any(trunc.values())
    assert env.agents == [] and rew["predator_0"] == 1.0 and rew["predator_1"] == 0.0


def test_walls_clip_moves_and_time_limit_truncates():
    env = PursuitEnv(n_predators=1, n_prey=1, grid_size=5, capture_radius=0, max_cycles=3)
    _place(env, [[0, 0]], [[4, 4]])
    for _t in range(3):
        _obs, _rew, term, trunc, _ = env.step({"predator_0": LEFT, "prey_0": UP})
    assert env.pred_pos.tolist() == [[0, 0]] and env.prey_pos.tolist() == [[4, 4]]
    assert all(trunc.values()) and not any(term.values()) and env.agents == []


def test_observation_holds_nearest_opponents_and_allies():
    env = PursuitEnv(n_predators=2, n_prey=3, grid_size=10, observe_nearest=2, observe_allies=1)
    _place(env, [[5, 5], [0, 0]], [[6, 5], [9, 9], [5, 2]])
    obs = env._observations(env.agents)["predator_0"]
    assert obs.shape == env.observation_space("predator_0").shape
    np.testing.assert_allclose(obs[:2], [0.5, 0.5])
    # Nearest prey: (6,5) at distance 1 then (5,2) at distance 3; ally predator_1 at (0,0).
    np.testing.assert_allclose(obs[2:8], [0.1, 0.0, 1.0, 0.0, -0.3, 1.0], atol=1e-6)
    np.testing.assert_allclose(obs[8:11], [-0.5, -0.5, 1.0], atol=1e-6)
    assert env.observation_space("predator_0").contains(obs)
