"""Torch policies (feature extractor + heads), built from the same JSON-able spec as their numpy twins.

``policy_spec`` describes the network for a pair of spaces (``envs/spaces.py`` says which spaces and how each is
read); ``ActorCritic`` (PPO) and ``QNetwork`` (DQN) build it. The extractor follows the observation (nothing to learn
for vectors, a CNN per image, SB3's combined extractor for Dict/Tuple), shared by the actor and critic MLPs as in
SB3's on-policy policies; the actor's head follows the action space (``agents/distributions.py``). The SAC/TD3
actors and critic live in ``agents/actors.py`` on the same base.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from opentinker.agents.distributions import ACTOR_CRITIC_HEADS
from opentinker.agents.extractors import FeatureExtractor, ObservationReader, mlp
from opentinker.envs.numpy_policy import ActionMap
from opentinker.envs.observations import map_obs, obs_leaves
from opentinker.envs.spaces import action_spec, observation_spec


def policy_spec(
    obs_space: gym.Space,
    action_space: gym.Space,
    value_based: bool,
    hidden: tuple[int, ...],
    activation: str,
    obs_norm_clip: float | None = None,
    actor: str | None = None,
) -> dict[str, Any]:
    """Describe the network for these spaces; unsupported spaces raise ``EnvSpecError`` naming the field.

    ``obs_norm_clip``: normalise the Box-vector parts of observations by the policy's running statistics, clipped to
    this bound (images are scaled by 1/255 instead). ``actor``: "squashed_gaussian" (SAC) or "deterministic" (TD3)
    for a Box action space; None gives PPO's heads (or DQN's Q head with ``value_based``).
    """
    spec: dict[str, Any] = {"hidden": list(hidden), "activation": activation, "obs": observation_spec(obs_space)}
    if obs_norm_clip is not None and any(part["kind"] == "box" for part in spec["obs"]["parts"]):
        spec["obs_norm"] = {"clip": float(obs_norm_clip)}
    spec.update(action_spec(action_space, value_based, actor))
    return spec


class SpecPolicy(nn.Module):
    """Shared plumbing: the feature extractor, observation statistics, numpy weight export and numpy ``act``.

    ``preprocess(obs)`` prepares a raw batch once (``ObservationReader``); ``extract(prepared)`` runs the learned
    extractor (per minibatch, so gradients reach the CNN); heads read the features.
    """

    spec: dict[str, Any]

    def _build_features(self, spec: dict[str, Any]) -> int:
        """Set ``spec``, the reader, the extractor and the observation statistics; returns the features' width."""
        self.spec = spec
        self.reader = ObservationReader(spec)
        self.features = FeatureExtractor(self.reader)
        if "obs_norm" in spec:  # buffers: saved with the weights, sent to workers, exported
            dim = self.reader.norm_dim
            self.register_buffer("obs_mean", torch.zeros(dim))
            self.register_buffer("obs_var", torch.ones(dim))
            self.register_buffer("obs_count", torch.full((), 1e-4))
        return self.reader.dim

    def _normalise(self, x: torch.Tensor, start: int) -> torch.Tensor:
        if "obs_norm" not in self.spec:
            return x
        clip, end = self.spec["obs_norm"]["clip"], start + x.shape[1]
        return ((x - self.obs_mean[start:end]) / torch.sqrt(self.obs_var[start:end] + 1e-8)).clamp(-clip, clip)

    def preprocess(self, obs: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Raw observation tensors (a batch) -> the prepared batch ``extract`` and the heads take."""
        return self.reader.prepare(obs, self._normalise)

    def extract(self, prepared: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.features(prepared) if self.reader.has_images else prepared

    @torch.no_grad()
    def update_obs_norm(self, obs: Any) -> None:
        """Fold a batch of raw observations (numpy) into the running statistics of the Box parts (no-op without
        ``obs_norm``)."""
        if "obs_norm" not in self.spec or len(obs_leaves(obs)[0]) == 0:
            return
        from opentinker.agents.normalize import update_moments

        leaves = [obs] if self.reader.container is None else [obs[part["key"]] for part in self.reader.parts]
        boxes = [leaf for part, leaf in zip(self.reader.parts, leaves) if part["kind"] == "box"]
        batch = np.concatenate([np.asarray(b, np.float64).reshape(len(b), -1) for b in boxes], axis=1)
        mean, var, count = update_moments(
            self.obs_mean.double().cpu().numpy(), self.obs_var.double().cpu().numpy(), float(self.obs_count), batch
        )
        self.obs_mean.copy_(torch.as_tensor(mean))
        self.obs_var.copy_(torch.as_tensor(var))
        self.obs_count.fill_(count)

    def numpy_weights(self) -> dict[str, np.ndarray]:
        return {k: v.detach().to("cpu", torch.float32).numpy().copy() for k, v in self.state_dict().items()}

    def is_single(self, obs: Any) -> bool:
        """Whether ``obs`` is one observation (not a batch): its leaves have the space's shapes."""
        parts = self.reader.parts
        leaves = [obs[part["key"]] for part in parts] if self.reader.container else [obs]
        return all(np.shape(leaf) == tuple(part["shape"]) for part, leaf in zip(parts, leaves))

    @torch.no_grad()
    def act(self, obs: Any, deterministic: bool = True) -> np.ndarray:
        """Actions for a batch (or one) observation; numpy in, numpy out, env-ready."""
        device = next(self.parameters()).device
        single = self.is_single(obs)
        x = map_obs(lambda leaf: torch.as_tensor(np.asarray(leaf)[None] if single else leaf, device=device), obs)
        actions = ActionMap(self.spec)(self._act(self.preprocess(x), deterministic).cpu().numpy())
        return actions[0] if single else actions

    @property
    def kind(self) -> str:
        return self.spec["kind"]


class ActorCritic(SpecPolicy):
    """Shared feature extractor, separate actor and critic MLPs (CleanRL layout); Gaussian heads use a
    state-independent log std."""

    def __init__(self, spec: dict[str, Any]):
        super().__init__()
        features = self._build_features(spec)
        self.head = ACTOR_CRITIC_HEADS[spec["kind"]](spec)
        hidden = [features, *spec["hidden"]]
        self.critic = mlp([*hidden, 1], spec["activation"], 1.0)
        self.actor = mlp([*hidden, self.head.param_dim], spec["activation"], 0.01)
        self.log_std = nn.Parameter(torch.zeros(spec["action_dim"])) if spec["kind"] == "gaussian" else None

    def value(self, x: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.critic(self.extract(x)).squeeze(-1)

    def evaluate_actions(self, x: torch.Tensor | tuple[torch.Tensor, ...], actions: torch.Tensor):
        """Log-probabilities and entropies of ``actions`` under the current policy, and state values."""
        features = self.extract(x)
        out = self.actor(features).float()
        value = self.critic(features).squeeze(-1).float()
        logp, entropy = self.head.log_prob_entropy(out, actions, self.log_std)
        return logp, entropy, value

    def _act(self, x: torch.Tensor | tuple[torch.Tensor, ...], deterministic: bool) -> torch.Tensor:
        return self.head.sample(self.actor(self.extract(x)).float(), deterministic, self.log_std)


class QNetwork(SpecPolicy):
    """Feature extractor + Q-value MLP; ``act`` is greedy."""

    def __init__(self, spec: dict[str, Any]):
        super().__init__()
        features = self._build_features(spec)
        self.q = mlp([features, *spec["hidden"], spec["action_dim"]], spec["activation"], 1.0)

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.q(self.extract(x))

    def _act(self, x: torch.Tensor | tuple[torch.Tensor, ...], deterministic: bool) -> torch.Tensor:
        return self(x).argmax(-1)
