"""The policy pieces of off-policy continuous control (SAC, TD3) on the same extractors as PPO and DQN.

Both actors act in the normalised action space [-1, 1]; ``envs.numpy_policy.env_actions`` scales to the Box bounds
(SB3's convention), so replay buffers and critics see [-1, 1] actions. Each network owns its feature extractor (SB3's
off-policy default: the critics' gradients never move the actor's CNN). Their numpy twins, export and serving are the
``squashed_gaussian`` and ``deterministic`` kinds of ``envs/numpy_policy.py``; build the spec with
``policy_spec(..., actor="squashed_gaussian" | "deterministic")``. Layers use PyTorch's default init (CleanRL's SAC
and TD3).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from opentinker.agents.distributions import HALF_LOG_2PI
from opentinker.agents.extractors import mlp
from opentinker.agents.policies import SpecPolicy
from opentinker.envs.numpy_policy import LOG_STD_BOUNDS

Prepared = torch.Tensor | tuple[torch.Tensor, ...]


class SquashedGaussianActor(SpecPolicy):
    """SAC's actor: features -> MLP -> (mean, log std); the action is tanh of a Gaussian sample, tanh(mean) when
    deterministic. The log std is squashed into ``LOG_STD_BOUNDS`` by a tanh (CleanRL)."""

    def __init__(self, spec: dict[str, Any]):
        super().__init__()
        if spec["kind"] != "squashed_gaussian":
            raise ValueError(f"SquashedGaussianActor needs a 'squashed_gaussian' spec, got {spec['kind']!r}")
        features = self._build_features(spec)
        self.actor = mlp([features, *spec["hidden"], 2 * spec["action_dim"]], spec["activation"], None)

    def mean_log_std(self, x: Prepared) -> tuple[torch.Tensor, torch.Tensor]:
        mean, raw = self.actor(self.extract(x)).float().chunk(2, dim=-1)
        low, high = LOG_STD_BOUNDS
        return mean, low + 0.5 * (high - low) * (torch.tanh(raw) + 1.0)

    def sample_with_log_prob(self, x: Prepared, noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised actions in [-1, 1] and their log-probabilities (SAC's policy and entropy terms).

        ``noise``: the standard normal draws, when the caller owns them (data-parallel learners drawing one batch of
        noise and sharding its rows); by default drawn here."""
        mean, log_std = self.mean_log_std(x)
        noise = torch.randn_like(mean) if noise is None else noise
        pre_tanh = mean + log_std.exp() * noise
        logp = (-0.5 * noise**2 - log_std - HALF_LOG_2PI).sum(-1)
        # minus log |d tanh(u)/du| = log(1 - tanh(u)^2), written stably: 2 (log 2 - u - softplus(-2u)).
        logp = logp - (2.0 * (math.log(2.0) - pre_tanh - F.softplus(-2.0 * pre_tanh))).sum(-1)
        return torch.tanh(pre_tanh), logp

    def _act(self, x: Prepared, deterministic: bool) -> torch.Tensor:
        if deterministic:
            return torch.tanh(self.mean_log_std(x)[0])
        return self.sample_with_log_prob(x)[0]


class DeterministicActor(SpecPolicy):
    """TD3's actor: features -> MLP -> tanh. Exploration noise is added by the collector (``spec["action_noise"]``)
    and by the target policy smoothing of the update."""

    def __init__(self, spec: dict[str, Any]):
        super().__init__()
        if spec["kind"] != "deterministic":
            raise ValueError(f"DeterministicActor needs a 'deterministic' spec, got {spec['kind']!r}")
        features = self._build_features(spec)
        self.actor = mlp([features, *spec["hidden"], spec["action_dim"]], spec["activation"], None)

    def forward(self, x: Prepared) -> torch.Tensor:
        return torch.tanh(self.actor(self.extract(x)).float())

    def _act(self, x: Prepared, deterministic: bool) -> torch.Tensor:
        return self(x)


class QCritic(SpecPolicy):
    """Q(s, a) for SAC/TD3: its own feature extractor, then an MLP over [features, action in [-1, 1]].

    Built from the actor's spec (same observation parts and action size). With ``obs_norm`` in the spec it holds its
    own statistics buffers: copy the actor's into it (``load_state_dict`` of those keys) when they change.
    """

    def __init__(self, spec: dict[str, Any]):
        super().__init__()
        features = self._build_features(spec)
        self.q = mlp([features + spec["action_dim"], *spec["hidden"], 1], spec["activation"], None)

    def forward(self, x: Prepared, actions: torch.Tensor) -> torch.Tensor:
        return self.q(torch.cat([self.extract(x), actions.reshape(len(actions), -1).float()], dim=-1)).squeeze(-1)

    def _act(self, x: Prepared, deterministic: bool) -> torch.Tensor:
        raise TypeError("QCritic is a critic: act with the actor")
