"""Networks of the continuous-action off-policy learners (SAC, TD3): tanh actors and a twin Q critic.

Actors act in [-1, 1] per action dimension (what the critics and the replay buffer see); ``env_actions`` scales that
to the Box bounds. Only the actor is exported and served: its spec and weights run in the numpy twin
(``envs/numpy_policy.py``) like the other policies.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import gymnasium as gym
import torch
import torch.nn.functional as F
from torch import nn

from opentinker.agents.policies import SpecPolicy, _mlp, policy_spec
from opentinker.envs.errors import EnvSpecError
from opentinker.envs.numpy_policy import LOG_STD_MAX, LOG_STD_MIN

_HALF_LOG_2PI, _LOG_2 = 0.5 * math.log(2 * math.pi), math.log(2.0)


def actor_spec(
    obs_space: gym.Space, action_space: gym.Space, kind: str, hidden: tuple[int, ...], activation: str
) -> dict[str, Any]:
    """The actor's spec: an MLP policy spec (observation handling, action bounds) of ``kind`` "squashed_gaussian"
    (SAC) or "deterministic" (TD3); only a 1-D Box with finite bounds is accepted as the action space."""
    if not isinstance(action_space, gym.spaces.Box):
        raise EnvSpecError(
            f"action_space {action_space} is not supported by this algorithm: expected a 1-D Box (continuous actions)"
        )
    return dict(policy_spec(obs_space, action_space, False, hidden, activation), kind=kind)


def scale_actions(actions: torch.Tensor, spec: dict[str, Any]) -> torch.Tensor:
    """[-1, 1] -> the Box bounds of the spec (the numpy twin's ``env_actions``)."""
    low = torch.as_tensor(spec["action_low"], dtype=actions.dtype, device=actions.device)
    high = torch.as_tensor(spec["action_high"], dtype=actions.dtype, device=actions.device)
    return low + (actions + 1.0) * 0.5 * (high - low)


class SquashedGaussianActor(SpecPolicy):
    """SAC's policy: an MLP giving the mean and log std of a Gaussian whose samples are squashed by tanh."""

    def __init__(self, spec: dict[str, Any]):
        super().__init__()
        self.spec = spec
        self.actor = _mlp([spec["obs_dim"], *spec["hidden"], 2 * spec["action_dim"]], spec["activation"], 0.01)
        self._add_obs_norm()

    def sample(self, x: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reparameterised actions ``tanh(mean + std * noise)`` and their log-densities (SAC paper, appendix C).

        ``noise`` is standard normal, drawn by the caller for the whole batch (learners take their rows of it).
        The tanh correction ``log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u))`` is the stable form."""
        mean, log_std = self.actor(x).float().chunk(2, dim=-1)
        log_std = log_std.clamp(LOG_STD_MIN, LOG_STD_MAX)
        u = mean + log_std.exp() * noise
        gaussian = (
            0.5 * noise.square() + log_std + _HALF_LOG_2PI
        )  # -log N(u; mean, std), since (u - mean) / std = noise
        squash = 2.0 * (_LOG_2 - u - F.softplus(-2.0 * u))
        return torch.tanh(u), -(gaussian + squash).sum(-1)

    def _act(self, x: torch.Tensor, deterministic: bool) -> torch.Tensor:
        mean, log_std = self.actor(x).float().chunk(2, dim=-1)
        if not deterministic:
            mean = mean + log_std.clamp(LOG_STD_MIN, LOG_STD_MAX).exp() * torch.randn_like(mean)
        return scale_actions(torch.tanh(mean), self.spec)


class DeterministicActor(SpecPolicy):
    """TD3's policy: an MLP squashed by tanh; exploration noise is added outside it."""

    def __init__(self, spec: dict[str, Any]):
        super().__init__()
        self.spec = spec
        self.actor = _mlp([spec["obs_dim"], *spec["hidden"], spec["action_dim"]], spec["activation"], 0.01)
        self._add_obs_norm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.actor(x).float())

    def _act(self, x: torch.Tensor, deterministic: bool) -> torch.Tensor:
        return scale_actions(self(x), self.spec)


class TwinQ(nn.Module):
    """``n`` Q networks Q(s, a) as one module: each layer's weights stacked as ``(n, in, out)``, so a layer of every
    critic is one batched matmul and one optimiser (one fused step) serves them all.

    ``frozen=True`` reads detached weights: the actor's loss needs gradients with respect to the actions only, and
    skipping the critics' weight gradients saves a third of that backward pass."""

    def __init__(self, obs_dim: int, action_dim: int, hidden: tuple[int, ...], activation: str, n: int = 2):
        super().__init__()
        sizes = [obs_dim + action_dim, *hidden]
        self.act = {"tanh": torch.tanh, "relu": torch.relu}[activation]
        self.weights = nn.ParameterList(
            nn.Parameter(torch.stack([_orthogonal(a, b, math.sqrt(2)) for _ in range(n)]))
            for a, b in itertools.pairwise(sizes)
        )
        self.biases = nn.ParameterList(nn.Parameter(torch.zeros(n, 1, b)) for b in sizes[1:])
        # The output layer as (n, 1, hidden) row vectors: a multiply-and-sum, far cheaper on CPU than a batched
        # matmul with one output column.
        self.out_weight = nn.Parameter(torch.stack([_orthogonal(sizes[-1], 1, 1.0).T for _ in range(n)]))
        self.out_bias = nn.Parameter(torch.zeros(n, 1))
        self.n = n

    def forward(self, x: torch.Tensor, actions: torch.Tensor, frozen: bool = False) -> torch.Tensor:
        """Q values of every critic, shape ``(n, batch)``."""
        params = [*self.weights, *self.biases, self.out_weight, self.out_bias]
        if frozen:
            params = [p.detach() for p in params]
        depth = len(self.weights)
        weights, biases, (out_weight, out_bias) = params[:depth], params[depth : 2 * depth], params[2 * depth :]
        h = torch.cat([x, actions.to(x.dtype)], dim=-1).expand(self.n, *x.shape[:-1], -1)
        for weight, bias in zip(weights, biases):
            h = self.act(torch.baddbmm(bias, h, weight))
        return (h.float() * out_weight).sum(-1) + out_bias


def _orthogonal(rows: int, cols: int, gain: float) -> torch.Tensor:
    """An orthogonally initialised ``(rows, cols)`` matrix (``_mlp``'s initialisation, in x @ W layout)."""
    weight = torch.empty(cols, rows)
    nn.init.orthogonal_(weight, gain)
    return weight.T.contiguous()
