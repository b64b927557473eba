"""Torch MLP policies, built from the same JSON-able spec as their numpy twins in ``numpy_policy``."""

from __future__ import annotations

import itertools
import math
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from opentinker.envs.errors import EnvSpecError

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def policy_spec(
    obs_space: gym.Space,
    action_space: gym.Space,
    value_based: bool,
    hidden: tuple[int, ...],
    activation: str,
    obs_norm_clip: float | None = None,
) -> dict[str, Any]:
    """Describe the network for these spaces; unsupported spaces raise ``EnvSpecError`` naming the field.

    ``obs_norm_clip``: normalise Box observations by the policy's running statistics, clipped to this bound.
    """
    spec: dict[str, Any] = {"hidden": list(hidden), "activation": activation}
    if obs_norm_clip is not None and isinstance(obs_space, gym.spaces.Box):
        spec["obs_norm"] = {"clip": float(obs_norm_clip)}
    if isinstance(obs_space, gym.spaces.Box):
        spec.update(obs_kind="box", obs_shape=list(obs_space.shape), obs_dim=int(np.prod(obs_space.shape)))
    elif isinstance(obs_space, gym.spaces.Discrete):
        spec.update(obs_kind="discrete", obs_shape=[], obs_dim=int(obs_space.n))
    else:
        raise EnvSpecError(
            f"observation_space {obs_space} is not supported by the MLP policies: expected Box or Discrete"
        )
    if isinstance(action_space, gym.spaces.Discrete):
        if int(action_space.start) != 0:
            raise EnvSpecError(f"action_space {action_space}: Discrete actions must start at 0")
        spec.update(kind="q" if value_based else "categorical", action_dim=int(action_space.n))
    elif isinstance(action_space, gym.spaces.Box) and not value_based and len(action_space.shape) == 1:
        if not (np.all(np.isfinite(action_space.low)) and np.all(np.isfinite(action_space.high))):
            raise EnvSpecError(f"action_space {action_space}: continuous actions need finite low/high bounds")
        spec.update(
            kind="gaussian",
            action_dim=int(action_space.shape[0]),
            action_low=action_space.low.tolist(),
            action_high=action_space.high.tolist(),
        )
    else:
        expected = "Discrete" if value_based else "Discrete or a 1-D Box"
        raise EnvSpecError(f"action_space {action_space} is not supported by this algorithm: expected {expected}")
    return spec


def _mlp(sizes: list[int], activation: str, last_std: float) -> nn.Sequential:
    act = {"tanh": nn.Tanh, "relu": nn.ReLU}[activation]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        linear = nn.Linear(a, b)
        last = i == len(sizes) - 2
        nn.init.orthogonal_(linear.weight, last_std if last else math.sqrt(2))
        nn.init.zeros_(linear.bias)
        layers += [linear] if last else [linear, act()]
    return nn.Sequential(*layers)


class SpecPolicy(nn.Module):
    """Shared plumbing: observation preprocessing, numpy weight export and numpy-in/numpy-out ``act``."""

    spec: dict[str, Any]

    def _add_obs_norm(self) -> None:
        """Running observation statistics as buffers: saved with the weights, sent to workers, exported."""
        if "obs_norm" in self.spec:
            dim = self.spec["obs_dim"]
            self.register_buffer("obs_mean", torch.zeros(dim))
            self.register_buffer("obs_var", torch.ones(dim))
            self.register_buffer("obs_count", torch.full((), 1e-4))

    def preprocess(self, obs: torch.Tensor) -> torch.Tensor:
        if self.spec["obs_kind"] == "discrete":
            return nn.functional.one_hot(obs.long().reshape(-1), self.spec["obs_dim"]).float()
        x = obs.reshape(-1, self.spec["obs_dim"]).float()
        if "obs_norm" in self.spec:
            clip = self.spec["obs_norm"]["clip"]
            x = ((x - self.obs_mean) / torch.sqrt(self.obs_var + 1e-8)).clamp(-clip, clip)
        return x

    @torch.no_grad()
    def update_obs_norm(self, obs: np.ndarray) -> None:
        """Fold a batch of raw observations into the running statistics (no-op without ``obs_norm``)."""
        if "obs_norm" not in self.spec or len(obs) == 0:
            return
        from opentinker.agents.normalize import update_moments

        batch = np.asarray(obs, np.float64).reshape(-1, self.spec["obs_dim"])
        mean, var, count = update_moments(
            self.obs_mean.double().cpu().numpy(), self.obs_var.double().cpu().numpy(), float(self.obs_count), batch
        )
        self.obs_mean.copy_(torch.as_tensor(mean))
        self.obs_var.copy_(torch.as_tensor(var))
        self.obs_count.fill_(count)

    def numpy_weights(self) -> dict[str, np.ndarray]:
        return {k: v.detach().to("cpu", torch.float32).numpy().copy() for k, v in self.state_dict().items()}

    @torch.no_grad()
    def act(self, obs: np.ndarray, deterministic: bool = True) -> np.ndarray:
        """Actions for a batch (or one) observation; numpy in, numpy out, env-ready."""
        device = next(self.parameters()).device
        x = torch.as_tensor(np.asarray(obs), device=device)
        actions = self._act(self.preprocess(x), deterministic).cpu().numpy()
        if self.spec["kind"] == "gaussian":
            actions = np.clip(actions, self.spec["action_low"], self.spec["action_high"]).astype(np.float32)
        single = np.asarray(obs).shape == tuple(self.spec["obs_shape"])
        return actions[0] if single else actions


class ActorCritic(SpecPolicy):
    """Separate actor and critic MLPs (CleanRL layout); Gaussian heads use a state-independent log std."""

    def __init__(self, spec: dict[str, Any]):
        super().__init__()
        self.spec = spec
        hidden = [spec["obs_dim"], *spec["hidden"]]
        self.critic = _mlp([*hidden, 1], spec["activation"], 1.0)
        self.actor = _mlp([*hidden, spec["action_dim"]], spec["activation"], 0.01)
        if spec["kind"] == "gaussian":
            self.log_std = nn.Parameter(torch.zeros(spec["action_dim"]))
        self._add_obs_norm()

    def value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x).squeeze(-1)

    def evaluate_actions(self, x: torch.Tensor, actions: torch.Tensor):
        """Log-probabilities and entropies of ``actions`` under the current policy, and state values.

        Written out instead of torch.distributions: the distribution objects' argument checks cost more than
        the maths for these small networks.
        """
        out = self.actor(x).float()
        value = self.value(x).float()
        if self.spec["kind"] == "categorical":
            logp_all = out.log_softmax(-1)
            logp = logp_all.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
            return logp, -(logp_all.exp() * logp_all).sum(-1), value
        log_std = self.log_std.expand_as(out)
        logp = (-0.5 * ((actions - out) / log_std.exp()) ** 2 - log_std - _HALF_LOG_2PI).sum(-1)
        return logp, (log_std + 0.5 + _HALF_LOG_2PI).sum(-1), value

    def _act(self, x: torch.Tensor, deterministic: bool) -> torch.Tensor:
        out = self.actor(x).float()
        if self.spec["kind"] == "categorical":
            return out.argmax(-1) if deterministic else torch.multinomial(out.softmax(-1), 1).squeeze(-1)
        return out if deterministic else out + self.log_std.exp() * torch.randn_like(out)


class QNetwork(SpecPolicy):
    """Q-value MLP; ``act`` is greedy."""

    def __init__(self, spec: dict[str, Any]):
        super().__init__()
        self.spec = spec
        self.q = _mlp([spec["obs_dim"], *spec["hidden"], spec["action_dim"]], spec["activation"], 1.0)
        self._add_obs_norm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x)

    def _act(self, x: torch.Tensor, deterministic: bool) -> torch.Tensor:
        return self.q(x).argmax(-1)
