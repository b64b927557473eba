"""SAC's and TD3's critics: ``n`` Q(s, a) networks as one module (SB3's ``ContinuousCritic`` layout: one feature
extractor of their own, shared by the Q heads; the actor keeps its own).

Each hidden layer of every head is one batched matmul over weights stacked ``(n, in, out)``, so the twin critics cost
one kernel per layer and one (fused) optimiser step, not two of each. Layers use PyTorch's default initialisation, as
the actors (``agents/actors.py``) and CleanRL's SAC/TD3.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch import nn

from opentinker.agents.actors import Prepared
from opentinker.agents.policies import SpecPolicy


def _linear_init(n: int, fan_in: int, shape: tuple[int, ...]) -> nn.Parameter:
    """``nn.Linear``'s default initialisation, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), for ``n`` stacked layers."""
    bound = 1.0 / math.sqrt(fan_in)
    return nn.Parameter(torch.empty(n, *shape).uniform_(-bound, bound))


class TwinQ(SpecPolicy):
    """``n`` critics over [features, action in [-1, 1]], built from the actor's spec; ``forward`` gives every critic's
    Q values, shape ``(n, batch)``.

    ``frozen=True`` reads detached weights (and computes the features without a graph): the actor's loss needs
    gradients with respect to the actions only, and skipping the critics' weight gradients saves a third of that
    backward pass."""

    def __init__(self, spec: dict[str, Any], n: int = 2):
        super().__init__()
        features = self._build_features(spec)
        sizes = [features + spec["action_dim"], *spec["hidden"]]
        self.act = {"tanh": torch.tanh, "relu": torch.relu}[spec["activation"]]
        self.weights = nn.ParameterList(_linear_init(n, a, (a, b)) for a, b in itertools.pairwise(sizes))
        self.biases = nn.ParameterList(_linear_init(n, a, (1, b)) for a, b in itertools.pairwise(sizes))
        # The output layer as (n, 1, hidden) row vectors: a multiply-and-sum, far cheaper on CPU than a batched matmul
        # with one output column.
        self.out_weight = _linear_init(n, sizes[-1], (1, sizes[-1]))
        self.out_bias = _linear_init(n, sizes[-1], (1,))
        self.n = n

    def forward(self, x: Prepared, actions: torch.Tensor, frozen: bool = False) -> torch.Tensor:
        params = [*self.weights, *self.biases, self.out_weight, self.out_bias]
        if frozen:
            params = [p.detach() for p in params]
            with torch.no_grad():
                features = self.extract(x)
        else:
            features = self.extract(x)
        depth = len(self.weights)
        weights, biases, (out_weight, out_bias) = params[:depth], params[depth : 2 * depth], params[2 * depth :]
        h = torch.cat([features, actions.reshape(len(actions), -1).to(features.dtype)], dim=-1)
        h = h.expand(self.n, *h.shape)
        for weight, bias in zip(weights, biases):
            h = self.act(torch.baddbmm(bias, h, weight))
        return (h.float() * out_weight).sum(-1) + out_bias

    def _act(self, x: Prepared, deterministic: bool) -> torch.Tensor:
        raise TypeError("TwinQ is a critic: act with the actor")
