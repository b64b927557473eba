"""The greedy action of every action kind is the mode of the distribution that trained, the same in the torch policy,
the numpy policy (rollout workers, evaluation), the export and the served forward pass (SB3's test_deterministic)."""

from __future__ import annotations

import json
import types

import gymnasium as gym
import numpy as np
import pytest
import torch

from opentinker.agents.export import export_policy, load_policy
from opentinker.agents.policies import ActorCritic, QNetwork, policy_spec
from opentinker.envs.numpy_policy import ActionMap, NumpyPolicy
from opentinker.envs.observations import map_obs

VECTOR = gym.spaces.Box(-1.0, 1.0, (5,), np.float32)
DICT = gym.spaces.Dict(
    {"image": gym.spaces.Box(0, 255, (8, 8, 1), np.uint8), "level": gym.spaces.Discrete(3), "x": VECTOR}
)
ACTIONS = {
    "discrete": gym.spaces.Discrete(4, start=2),
    "multi_discrete": gym.spaces.MultiDiscrete(np.array([[3, 4], [2, 5]]), start=np.array([[1, 0], [-2, 3]])),
    "multi_binary": gym.spaces.MultiBinary([2, 3]),
    "box": gym.spaces.Box(np.array([-1.0, 0.0, -2.0], np.float32), np.array([1.0, 0.5, 2.0], np.float32)),
}


def sharp_policy(obs_space: gym.Space, action_space: gym.Space, value_based: bool = False):
    """A freshly built policy whose actor outputs are large and varied (the init's 0.01 gain makes every mode a
    near-tie), with observation normalisation on so its statistics are part of what must match."""
    torch.manual_seed(0)
    spec = policy_spec(obs_space, action_space, value_based, (16,), "tanh", obs_norm_clip=5.0)
    policy = (QNetwork if value_based else ActorCritic)(spec)
    with torch.no_grad():
        head = policy.q if value_based else policy.actor
        head[-1].weight.mul_(300.0)
        if getattr(policy, "log_std", None) is not None:
            policy.log_std.fill_(-0.5)
        if "obs_norm" in spec:
            policy.obs_mean.uniform_(-0.3, 0.3)
            policy.obs_var.uniform_(0.5, 2.0)
    policy.observation_space, policy.action_space = obs_space, action_space
    return policy


def observations(space: gym.Space, n: int = 64):
    space.seed(1)
    samples = [space.sample() for _ in range(n)]
    if isinstance(space, gym.spaces.Dict):
        return {key: np.stack([s[key] for s in samples]) for key in space.spaces}
    return np.stack(samples)


def mode(policy, obs) -> np.ndarray:
    """The distribution's mode, computed here from the actor's raw outputs (not by any ``sample``/``act``)."""
    x = map_obs(torch.as_tensor, obs)
    with torch.no_grad():
        features = policy.extract(policy.preprocess(x))
        out = (policy.q if policy.kind == "q" else policy.actor)(features).numpy()
    kind, spec = policy.kind, policy.spec
    if kind in ("categorical", "q"):
        raw = out.argmax(1)
    elif kind == "multi_categorical":
        parts = np.split(out, np.cumsum(spec["action_nvec"])[:-1], axis=1)
        raw = np.stack([part.argmax(1) for part in parts], axis=1)
    elif kind == "bernoulli":
        raw = (out > 0).astype(np.int8)  # p(1) = sigmoid(logit) > 1/2
    else:
        raw = out  # a Gaussian's mode is its mean (then clipped to the bounds, as every path does)
    return ActionMap(spec)(raw)


def served_actions(export_dir, obs, n: int) -> list:
    """What ``/act`` answers for each observation: the policy service's own loading, request validation (a JSON
    body) and forward pass."""
    from opentinker.serving.model_slot import load_served_model

    served = load_served_model(str(export_dir))
    answers = []
    for i in range(n):
        single = map_obs(lambda leaf, i=i: leaf[i].tolist(), obs)
        validated = served.schema.validate(json.loads(json.dumps(single)))
        batch = map_obs(lambda leaf: leaf[None], validated)
        action = served.policy.act(batch)[0]
        info_action = served.policy.act_with_info(batch)[0][0]
        assert np.array_equal(action, info_action)
        answers.append(action.tolist())
    return answers


@pytest.mark.parametrize("obs_space", [VECTOR, DICT], ids=["vector", "dict"])
@pytest.mark.parametrize("kind", sorted(ACTIONS))
def test_greedy_action_is_the_mode_everywhere(kind, obs_space, tmp_path):
    action_space = ACTIONS[kind]
    policy = sharp_policy(obs_space, action_space)
    obs = observations(obs_space)
    expected = mode(policy, obs)
    assert len({tuple(np.ravel(a)) for a in expected}) > 1, "the test policy should not answer one action everywhere"
    for a in expected:
        assert action_space.contains(np.asarray(a, action_space.dtype) if action_space.shape else int(a))

    np.testing.assert_allclose(policy.act(obs, deterministic=True), expected, rtol=1e-5, atol=1e-5)
    numpy_policy = NumpyPolicy(policy.spec, policy.numpy_weights())
    np.testing.assert_allclose(numpy_policy.act(obs), expected, rtol=1e-5, atol=1e-5)
    greedy_raw = numpy_policy.sample(obs, None, deterministic=True)[0]
    np.testing.assert_allclose(numpy_policy.env_actions(greedy_raw), expected, rtol=1e-5, atol=1e-5)

    export_dir = export_policy(policy, tmp_path / "export")
    exported = load_policy(export_dir)
    np.testing.assert_allclose(exported.act(obs), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(exported.act_with_info(obs)[0], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(served_actions(export_dir, obs, 8), expected[:8], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["discrete", "multi_discrete", "multi_binary"])
def test_greedy_action_is_at_least_as_likely_as_any_sample(kind):
    """The mode by the distribution's own log-probability: no sampled action is more likely than the greedy one."""
    policy = sharp_policy(VECTOR, ACTIONS[kind])
    for layer in policy.actor[:-1]:  # a softer policy, so that samples differ from the mode
        if isinstance(layer, torch.nn.Linear):
            layer.weight.data.mul_(0.01)
    policy.actor[-1].weight.data.mul_(1 / 300.0)
    obs = observations(VECTOR, 16)
    numpy_policy = NumpyPolicy(policy.spec, policy.numpy_weights())
    greedy, greedy_logp, _ = numpy_policy.sample(obs, None, deterministic=True)
    rng = np.random.default_rng(0)
    for _ in range(50):
        _, logp, _ = numpy_policy.sample(obs, rng)
        assert np.all(logp <= greedy_logp + 1e-5)
    x = policy.preprocess(torch.as_tensor(obs))
    torch_logp = policy.evaluate_actions(x, torch.as_tensor(greedy))[0].detach().numpy()
    np.testing.assert_allclose(torch_logp, greedy_logp, rtol=1e-4, atol=1e-4)


def test_q_network_greedy_is_the_argmax_everywhere(tmp_path):
    policy = sharp_policy(VECTOR, ACTIONS["discrete"], value_based=True)
    obs = observations(VECTOR)
    expected = mode(policy, obs)
    np.testing.assert_array_equal(policy.act(obs), expected)
    np.testing.assert_array_equal(NumpyPolicy(policy.spec, policy.numpy_weights()).act(obs), expected)
    trainer_like = types.SimpleNamespace(
        policy=policy, algorithm="dqn", env_id=None, observation_space=VECTOR, action_space=ACTIONS["discrete"]
    )
    export_dir = export_policy(trainer_like, tmp_path / "export")
    np.testing.assert_array_equal(load_policy(export_dir).act(obs), expected)
    assert served_actions(export_dir, obs, 8) == expected[:8].tolist()


def test_evaluation_reports_greedy_and_sampled_returns():
    """``Trainer.evaluate`` plays the mode by default and samples on request (the same seeds, reproducibly)."""
    from opentinker.agents.ppo import PPO

    trainer = PPO("opentinker.envs.bench_envs:GridReachEnv", num_envs=2, backend="local", device="cpu")
    greedy = trainer.evaluate(episodes=8, seed=3)
    sampled = trainer.evaluate(episodes=8, seed=3, deterministic=False)
    assert greedy == trainer.evaluate(episodes=8, seed=3)
    assert sampled == trainer.evaluate(episodes=8, seed=3, deterministic=False)
    assert greedy.returns != sampled.returns  # an untrained policy: greedy walks into the same wall every step
    trainer.env.close()
