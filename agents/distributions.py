"""Torch action heads of the actor-critic, one per action kind (SB3's ``distributions``), from the actor's output.

Written out instead of ``torch.distributions``: the distribution objects' argument checks cost more than the maths
for these small networks. The numpy twins (sampling in rollout workers) are in ``envs/numpy_policy.py``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


class Categorical:
    """Discrete actions: a softmax over the actor's logits."""

    def __init__(self, spec: dict[str, Any]):
        self.param_dim = spec["action_dim"]

    @staticmethod
    def log_prob_entropy(logits: torch.Tensor, actions: torch.Tensor, log_std=None):
        logp_all = logits.log_softmax(-1)
        logp = logp_all.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
        return logp, -(logp_all.exp() * logp_all).sum(-1)

    @staticmethod
    def sample(logits: torch.Tensor, deterministic: bool, log_std=None) -> torch.Tensor:
        return logits.argmax(-1) if deterministic else torch.multinomial(logits.softmax(-1), 1).squeeze(-1)


class MultiCategorical:
    """MultiDiscrete actions: one independent categorical per dimension over its slice of the logits."""

    def __init__(self, spec: dict[str, Any]):
        self.nvec = list(spec["action_nvec"])
        self.param_dim = sum(self.nvec)

    def log_prob_entropy(self, logits: torch.Tensor, actions: torch.Tensor, log_std=None):
        logp = entropy = 0.0
        for i, part in enumerate(logits.split(self.nvec, dim=-1)):
            lp, ent = Categorical.log_prob_entropy(part, actions[:, i])
            logp, entropy = logp + lp, entropy + ent
        return logp, entropy

    def sample(self, logits: torch.Tensor, deterministic: bool, log_std=None) -> torch.Tensor:
        parts = logits.split(self.nvec, dim=-1)
        return torch.stack([Categorical.sample(part, deterministic) for part in parts], dim=-1)


class Bernoulli:
    """MultiBinary actions: an independent Bernoulli per bit, the actor's outputs as logits."""

    def __init__(self, spec: dict[str, Any]):
        self.param_dim = spec["action_dim"]

    def log_prob_entropy(self, logits: torch.Tensor, actions: torch.Tensor, log_std=None):
        bits = actions.reshape(logits.shape).float()
        logp = (bits * logits - F.softplus(logits)).sum(-1)  # log sigmoid(l) if 1, log sigmoid(-l) if 0
        entropy = (F.softplus(logits) - logits * torch.sigmoid(logits)).sum(-1)
        return logp, entropy

    def sample(self, logits: torch.Tensor, deterministic: bool, log_std=None) -> torch.Tensor:
        bits = logits > 0 if deterministic else torch.bernoulli(torch.sigmoid(logits)).bool()
        return bits.to(torch.int8)


class DiagGaussian:
    """Box actions (PPO): the actor's output is the mean; ``log_std`` a state-independent parameter."""

    def __init__(self, spec: dict[str, Any]):
        self.param_dim = spec["action_dim"]

    def log_prob_entropy(self, mean: torch.Tensor, actions: torch.Tensor, log_std: torch.Tensor):
        log_std = log_std.expand_as(mean)
        logp = (-0.5 * ((actions - mean) / log_std.exp()) ** 2 - log_std - HALF_LOG_2PI).sum(-1)
        return logp, (log_std + 0.5 + HALF_LOG_2PI).sum(-1)

    def sample(self, mean: torch.Tensor, deterministic: bool, log_std: torch.Tensor) -> torch.Tensor:
        return mean if deterministic else mean + log_std.exp() * torch.randn_like(mean)


ACTOR_CRITIC_HEADS = {
    "categorical": Categorical,
    "multi_categorical": MultiCategorical,
    "bernoulli": Bernoulli,
    "gaussian": DiagGaussian,
}
