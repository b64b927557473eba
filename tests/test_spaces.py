"""Every supported space through the engine's pieces: how each observation is read (images detected, Dict/Tuple
combined), the numpy forward pass equal to the torch one for every extractor and head, exports, the state_diff
codec and the replay buffer keeping structure and dtypes, and the one-line refusal of what is not supported."""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from opentinker.agents.actors import DeterministicActor, QCritic, SquashedGaussianActor
from opentinker.agents.buffers import ReplayBuffer
from opentinker.agents.export import export_policy, load_policy
from opentinker.agents.policies import ActorCritic, QNetwork, policy_spec
from opentinker.envs import EnvSpecError, EnvValidationError, RemoteEnv, validate_env
from opentinker.envs.numpy_policy import NumpyPolicy
from opentinker.envs.observations import map_obs, stack_obs
from opentinker.envs.spaces import image_layout, observation_spec
from opentinker.envs.state_diff import decode_observations, encode_observations

IMAGE_HWC = gym.spaces.Box(0, 255, (16, 16, 3), np.uint8)
IMAGE_CHW = gym.spaces.Box(0, 255, (4, 40, 40), np.uint8)  # Nature CNN size, channel-first (frame stack)
VECTOR = gym.spaces.Box(-2.0, 2.0, (3,), np.float32)
DICT = gym.spaces.Dict(
    {
        "grey": gym.spaces.Box(0, 255, (12, 10), np.uint8),
        "pos": VECTOR,
        "mode": gym.spaces.Discrete(3, start=1),
        "bits": gym.spaces.MultiBinary(2),
        "cell": gym.spaces.MultiDiscrete([2, 3]),
    }
)
TUPLE = gym.spaces.Tuple((IMAGE_HWC, VECTOR))
BOX_ACTION = gym.spaces.Box(np.array([-1.0, 0.0], np.float32), np.array([1.0, 4.0], np.float32))
ACTION_SPACES = {
    "discrete": gym.spaces.Discrete(4),
    "multi_discrete": gym.spaces.MultiDiscrete([3, 2, 4]),
    "multi_binary": gym.spaces.MultiBinary(5),
    "box": BOX_ACTION,
}
OBSERVATION_SPACES = {"vector": VECTOR, "image_hwc": IMAGE_HWC, "image_chw": IMAGE_CHW, "dict": DICT, "tuple": TUPLE}


def sample_batch(space: gym.Space, n: int, seed: int = 0):
    space.seed(seed)
    return stack_obs([space.sample() for _ in range(n)])


def to_torch(obs):
    return map_obs(torch.as_tensor, obs)


def test_images_are_detected_as_sb3_detects_them():
    assert image_layout(gym.spaces.Box(0, 255, (84, 84, 4), np.uint8)) == "hwc"
    assert image_layout(gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)) == "chw"
    assert image_layout(gym.spaces.Box(0, 255, (84, 84), np.uint8)) == "hw"
    assert image_layout(gym.spaces.Box(0.0, 1.0, (84, 84, 4), np.float32)) is None  # floats are vectors
    assert image_layout(gym.spaces.Box(0, 255, (4, 4, 3), np.uint8)) is None  # too small to be read as an image
    assert image_layout(gym.spaces.Box(0, 10, (84, 84, 4), np.uint8)) is None  # not pixel bounds
    nature = observation_spec(gym.spaces.Box(0, 255, (4, 84, 84), np.uint8))["parts"][0]
    assert nature["convs"] == [[32, 8, 4], [64, 4, 2], [64, 3, 1]] and nature["conv_flat"] == 64 * 7 * 7
    assert nature["dim"] == 512 and nature["channels"] == 4
    small = observation_spec(IMAGE_HWC)["parts"][0]  # under 36 pixels a side: pixels / 255 into one linear layer
    assert small["convs"] == [] and small["conv_flat"] == 16 * 16 * 3 and small["dim"] == 256
    parts = observation_spec(DICT)["parts"]
    kinds = {"bits": "multi_binary", "cell": "multi_discrete", "grey": "image", "mode": "discrete", "pos": "box"}
    assert [(p["key"], p["kind"]) for p in parts] == list(kinds.items())  # gymnasium's (sorted) key order


def assert_same_actions(a: np.ndarray, b: np.ndarray) -> None:
    """Discrete actions equal; continuous ones equal up to float32 rounding (numpy and torch sum in other orders)."""
    assert a.dtype == b.dtype
    if a.dtype.kind == "f":
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(a, b)


def _randomise_norm(policy: torch.nn.Module) -> None:
    if hasattr(policy, "obs_mean"):
        generator = torch.Generator().manual_seed(3)
        policy.obs_mean.copy_(torch.randn(policy.obs_mean.shape, generator=generator))
        policy.obs_var.copy_(torch.rand(policy.obs_var.shape, generator=generator) + 0.5)


@pytest.mark.parametrize("action", sorted(ACTION_SPACES))
@pytest.mark.parametrize("observation", sorted(OBSERVATION_SPACES))
def test_numpy_forward_equals_torch_for_every_extractor_and_head(observation, action):
    obs_space, act_space = OBSERVATION_SPACES[observation], ACTION_SPACES[action]
    torch.manual_seed(0)
    policy = ActorCritic(policy_spec(obs_space, act_space, False, (32,), "tanh", obs_norm_clip=5.0))
    _randomise_norm(policy)
    twin = NumpyPolicy(policy.spec, policy.numpy_weights())
    obs = sample_batch(obs_space, 6)
    with torch.no_grad():
        prepared = policy.preprocess(to_torch(obs))
        np.testing.assert_allclose(twin.features(obs), policy.extract(prepared).numpy(), rtol=1e-5, atol=1e-5)
        # Actions sampled by the numpy twin (rollout workers) are scored the same by the torch learner.
        actions, logp, values = twin.sample(obs, np.random.default_rng(1))
        torch_logp, _, torch_values = policy.evaluate_actions(prepared, torch.as_tensor(actions))
    np.testing.assert_allclose(logp, torch_logp.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(values, torch_values.numpy(), rtol=1e-5, atol=1e-5)
    env_actions = twin.act(obs)
    assert_same_actions(env_actions, policy.act(obs))
    assert all(act_space.contains(a) for a in env_actions), env_actions
    assert_same_actions(policy.act(map_obs(lambda leaf: leaf[0], obs)), env_actions[0])  # one observation, unbatched


@pytest.mark.parametrize("observation", ["vector", "dict"])
def test_dqn_and_off_policy_actors_match_their_numpy_twins(observation):
    obs_space = OBSERVATION_SPACES[observation]
    obs = sample_batch(obs_space, 5)
    torch.manual_seed(0)
    q = QNetwork(policy_spec(obs_space, gym.spaces.Discrete(3), True, (16,), "relu"))
    np.testing.assert_array_equal(NumpyPolicy(q.spec, q.numpy_weights()).act(obs), q.act(obs))
    for actor_cls, kind in ((SquashedGaussianActor, "squashed_gaussian"), (DeterministicActor, "deterministic")):
        actor = actor_cls(policy_spec(obs_space, BOX_ACTION, False, (16, 16), "relu", actor=kind))
        twin = NumpyPolicy(actor.spec, actor.numpy_weights())
        mean_action = twin.act(obs)
        np.testing.assert_allclose(mean_action, actor.act(obs), rtol=1e-5, atol=1e-5)
        assert mean_action.shape == (5, 2) and all(BOX_ACTION.contains(a) for a in mean_action)
        sampled, _, _ = twin.sample(obs, np.random.default_rng(0))
        assert np.all(np.abs(sampled) <= 1.0)  # the policy's own actions live in [-1, 1]
        np.testing.assert_allclose(twin.env_actions(np.ones((1, 2), np.float32)), [[1.0, 4.0]])
    # SAC's log-probability: the torch reparameterised sample and the numpy one agree on the same noise.
    actor = SquashedGaussianActor(policy_spec(obs_space, BOX_ACTION, False, (16,), "relu", actor="squashed_gaussian"))
    torch.manual_seed(5)
    with torch.no_grad():
        action, logp = actor.sample_with_log_prob(actor.preprocess(to_torch(obs)))
        mean, log_std = actor.mean_log_std(actor.preprocess(to_torch(obs)))
    noise = (torch.atanh(action.clamp(-1 + 1e-6, 1 - 1e-6)) - mean) / log_std.exp()
    expected = torch.distributions.Normal(mean, log_std.exp()).log_prob(mean + log_std.exp() * noise).sum(-1)
    expected -= torch.log(1 - action.pow(2) + 1e-6).sum(-1)
    np.testing.assert_allclose(logp.numpy(), expected.numpy(), rtol=1e-3, atol=1e-3)
    critic = QCritic(actor.spec)
    assert critic(actor.preprocess(to_torch(obs)), action).shape == (5,)


@pytest.mark.parametrize("observation", sorted(OBSERVATION_SPACES))
def test_exports_load_without_torch_and_act_like_the_trainer(tmp_path, observation):
    obs_space, act_space = OBSERVATION_SPACES[observation], ACTION_SPACES["multi_discrete"]
    policy = ActorCritic(policy_spec(obs_space, act_space, False, (16,), "tanh"))
    policy.observation_space, policy.action_space = obs_space, act_space
    loaded = load_policy(export_policy(policy, tmp_path))
    assert loaded.observation_space == obs_space and loaded.action_space == act_space
    obs = sample_batch(obs_space, 4)
    np.testing.assert_array_equal(loaded.act(obs), policy.act(obs))
    if isinstance(obs, (dict, tuple)):  # a list of single observations is a batch too (what HTTP clients send)
        rows = [map_obs(lambda leaf, i=i: leaf[i], obs) for i in range(4)]
        np.testing.assert_array_equal(loaded.act(rows), policy.act(obs))
    _, probs, values = loaded.act_with_info(obs)
    assert probs.shape == (4, 9) and values.shape == (4,)


def test_format_1_exports_still_load(tmp_path):
    """Exports from before structured observations describe the input with obs_kind/obs_shape/obs_dim."""
    space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    policy = ActorCritic(policy_spec(space, gym.spaces.Discrete(2), False, (8,), "tanh"))
    policy.observation_space, policy.action_space = space, gym.spaces.Discrete(2)
    export_policy(policy, tmp_path)
    spec = json.loads((tmp_path / "policy.json").read_text())
    architecture = spec["architecture"]
    del architecture["obs"], architecture["action_start"]
    architecture.update(obs_kind="box", obs_shape=[4], obs_dim=4)
    (tmp_path / "policy.json").write_text(json.dumps({**spec, "format_version": 1}))
    obs = sample_batch(space, 3)
    np.testing.assert_array_equal(load_policy(tmp_path).act(obs), policy.act(obs))


def test_state_diff_and_rollouts_keep_dict_and_image_observations_structured():
    kwargs = dict(parallel=4, workers=2, backend="local", seed=3)
    spec = policy_spec(DICT_ENV_SPACE, gym.spaces.Discrete(4), False, (8,), "tanh")
    weights = ActorCritic(spec).numpy_weights()
    with RemoteEnv(DICT_ENV, state_diff=True, **kwargs) as diffed, RemoteEnv(DICT_ENV, **kwargs) as plain:
        a, b = diffed.collect(weights, spec, 16, 0), plain.collect(weights, spec, 16, 0)
    assert set(a.obs) == {"image", "vector"} and a.obs["image"].dtype == np.uint8
    assert a.obs["image"].shape == (16, 4, 8, 8, 1) and a.last_obs["vector"].shape == (4, 2)
    for key in a.obs:
        np.testing.assert_array_equal(a.obs[key], b.obs[key])
    assert a.bytes_sent < a.bytes_raw == b.bytes_raw == b.bytes_sent
    frames = {"image": np.zeros((5, 2, 84, 84, 4), np.uint8), "vector": np.full((5, 2, 3), -0.0, np.float32)}
    frames["image"][:, :, 10:20] = 255
    decoded = decode_observations(encode_observations(frames))
    assert decoded["image"].dtype == np.uint8 and np.array_equal(decoded["image"], frames["image"])
    assert np.signbit(decoded["vector"]).all()
    pair = decode_observations(encode_observations((frames["image"], frames["vector"])))
    assert isinstance(pair, tuple) and np.array_equal(pair[0], frames["image"])


DICT_ENV = "opentinker.envs.identity:DictIdentityEnv"
DICT_ENV_SPACE = gym.spaces.Dict(
    {"image": gym.spaces.Box(0, 255, (8, 8, 1), np.uint8), "vector": gym.spaces.Box(-1.0, 1.0, (2,), np.float32)}
)


def test_replay_buffer_keeps_structure_and_uint8():
    buffer = ReplayBuffer(8)
    obs = {"image": np.arange(5 * 4, dtype=np.uint8).reshape(5, 2, 2), "pos": np.ones((5, 3), np.float32)}
    buffer.add(obs, obs, np.arange(5), np.ones(5, np.float32), np.zeros(5, np.float32))
    buffer.add(obs, obs, np.arange(5), np.ones(5, np.float32), np.zeros(5, np.float32))  # wraps around
    assert len(buffer) == 8 and buffer.data["obs"]["image"].dtype == np.uint8
    batch = buffer.sample((3, 4), np.random.default_rng(0))
    assert batch["next_obs"]["image"].shape == (3, 4, 2, 2) and batch["obs"]["pos"].shape == (3, 4, 3)
    restored = ReplayBuffer(8)
    restored.load_state_dict(buffer.state_dict())
    for key in ("image", "pos"):
        np.testing.assert_array_equal(restored.data["obs"][key], buffer.data["obs"][key])


class _Env(gym.Env):
    """A one-step env over the given spaces (observations sampled from the space)."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space):
        self.observation_space, self.action_space = observation_space, action_space

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            self.observation_space.seed(seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 0.0, True, False, {}


def graph_obs_env() -> gym.Env:
    return _Env(gym.spaces.Graph(gym.spaces.Box(0.0, 1.0, (3,)), None), gym.spaces.Discrete(2))


UNSUPPORTED = {
    "graph": (graph_obs_env, "observation_space Graph("),
    "sequence": (
        lambda: _Env(gym.spaces.Sequence(gym.spaces.Discrete(3)), gym.spaces.Discrete(2)),
        "observation_space Sequence(",
    ),
    "nested dict": (
        lambda: _Env(gym.spaces.Dict({"a": gym.spaces.Dict({"b": VECTOR})}), gym.spaces.Discrete(2)),
        "observation_space['a'] Dict(",
    ),
    "text for a numeric policy": (
        lambda: _Env(gym.spaces.Text(8), gym.spaces.Discrete(2)),
        "observation_space Text(",
    ),
    "tuple action": (
        lambda: _Env(VECTOR, gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Discrete(2)))),
        "action_space Tuple(",
    ),
}


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_unsupported_spaces_are_refused_in_one_line(case):
    factory, start = UNSUPPORTED[case]
    with pytest.raises(EnvValidationError) as info:
        validate_env(factory)
    assert len(info.value.problems) == 1, info.value.problems
    problem = info.value.problems[0]
    assert problem.startswith(start) and "\n" not in problem, problem
    assert "supported" in problem and "truth value" not in problem, problem


def test_the_cli_refuses_an_unsupported_space_in_one_line():
    from opentinker.cli import app

    result = CliRunner().invoke(app, ["train", "test_spaces:graph_obs_env"])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: env_id:"), result.output
    assert "Graph(" in lines[0] and "expected Box" in lines[0] and "Traceback" not in result.output


def test_validate_env_accepts_the_shipped_envs_of_every_space():
    for name in ("DictIdentityEnv", "MultiDiscreteIdentityEnv", "MultiBinaryIdentityEnv", "ImageIdentityEnv"):
        validate_env(f"opentinker.envs.identity:{name}")
    validate_env(lambda: _Env(TUPLE, BOX_ACTION))
    with pytest.raises(EnvValidationError, match=r"reset\(\)\['vector'\]: observation dtype float64"):
        validate_env(lambda: _BadDict())


class _BadDict(_Env):
    def __init__(self):
        super().__init__(DICT_ENV_SPACE, gym.spaces.Discrete(2))

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed)
        return {**obs, "vector": obs["vector"].astype(np.float64)}, info


def test_presets_put_multi_discrete_actions_in_the_discrete_family():
    from opentinker.flows.presets import PPO_DISCRETE, engine_preset, problem_kind

    kind = problem_kind("opentinker.envs.identity:MultiBinaryIdentityEnv")
    assert kind.actions == "multi-discrete" and kind.family == "multi-discrete"  # no spec: 16-step episodes measured
    assert kind.episode_steps == 16 and not kind.registered
    assert engine_preset("ppo", "opentinker.envs.identity:MultiDiscreteIdentityEnv") == PPO_DISCRETE
    with pytest.raises(ValueError, match="'dqn' does not handle multi-discrete actions"):
        engine_preset("dqn", "opentinker.envs.identity:MultiDiscreteIdentityEnv")
    with pytest.raises(EnvSpecError, match=r"MultiDiscrete.* is not supported by this algorithm: expected Discrete"):
        policy_spec(VECTOR, ACTION_SPACES["multi_discrete"], True, (8,), "relu")


def test_sac_and_td3_actors_export_and_serve_like_ppo(tmp_path):
    for kind in ("squashed_gaussian", "deterministic"):
        actor_cls = SquashedGaussianActor if kind == "squashed_gaussian" else DeterministicActor
        actor = actor_cls(policy_spec(DICT_ENV_SPACE, BOX_ACTION, False, (16,), "relu", actor=kind))
        actor.observation_space, actor.action_space = DICT_ENV_SPACE, BOX_ACTION
        loaded = load_policy(export_policy(actor, tmp_path / kind))
        assert loaded.spec["algorithm"] == {"squashed_gaussian": "sac", "deterministic": "td3"}[kind]
        obs = sample_batch(DICT_ENV_SPACE, 3)
        np.testing.assert_allclose(loaded.act(obs), actor.act(obs), rtol=1e-5, atol=1e-6)
        actions, probs, values = loaded.act_with_info(obs)
        assert actions.shape == (3, 2) and probs is None and values is None


def test_a_policy_whose_observation_cannot_fit_a_request_is_refused_at_start():
    from opentinker.serving.observation import check_request_limit, observation_schema

    frames = observation_schema(gym.spaces.Box(0, 255, (600, 400, 3), np.uint8))
    with pytest.raises(ValueError, match=r"at least 1440000 bytes .* max_body_bytes=1048576; raise OPENTINKER_SERVE"):
        check_request_limit(frames, 1 << 20)
    check_request_limit(observation_schema(DICT_ENV_SPACE), 1 << 20)  # 2 x (64 + 2) bytes: fits
