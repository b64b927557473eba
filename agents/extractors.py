"""Torch feature extractors, one per observation kind (SB3's ``torch_layers``), built from the policy spec.

A policy reads observations in two steps. ``ObservationReader.prepare`` is the parameter-free part, run once per
batch: Box vectors flattened and normalised by the running statistics, one-hots for Discrete/MultiDiscrete, floats for
MultiBinary, and images only reordered to channels-first (still uint8: a rollout batch of Atari frames as float32
would be 4x the memory). ``FeatureExtractor`` is the learned part, run per minibatch: each image scaled by 1/255
through its CNN (the Nature CNN; an image under 36 pixels a side has no convolutions, only the linear layer), and
every part concatenated in space order (SB3's ``CombinedExtractor`` for Dict/Tuple observations). Without images the
prepared batch already is the features.

The numpy twin is ``envs/numpy_features.py``: same spec, same weight names (``features.<part>.convs.<i>`` ...).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch import nn

from opentinker.envs.numpy_features import observation_layout


def mlp(sizes: list[int], activation: str, last_std: float | None) -> nn.Sequential:
    """Linear layers with ``activation`` between them; orthogonal init (gain sqrt 2, ``last_std`` on the last
    layer) as CleanRL's PPO, or PyTorch's default init everywhere when ``last_std`` is None (CleanRL's SAC/TD3)."""
    act = {"tanh": nn.Tanh, "relu": nn.ReLU}[activation]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        linear = nn.Linear(a, b)
        last = i == len(sizes) - 2
        if last_std is not None:
            nn.init.orthogonal_(linear.weight, last_std if last else math.sqrt(2))
            nn.init.zeros_(linear.bias)
        layers += [linear] if last else [linear, act()]
    return nn.Sequential(*layers)


class ImageEncoder(nn.Module):
    """Conv + ReLU layers, flatten, linear + ReLU: the Nature CNN, or for a small image no conv layers (the spec's)."""

    def __init__(self, part: dict[str, Any]):
        super().__init__()
        layers: list[nn.Module] = []
        channels = part["channels"]
        for out, kernel, stride in part["convs"]:
            layers += [nn.Conv2d(channels, out, kernel, stride), nn.ReLU()]
            channels = out
        self.convs = nn.Sequential(*layers)
        self.linear = nn.Linear(part["conv_flat"], part["dim"])
        for module in (*self.convs, self.linear):
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.orthogonal_(module.weight, math.sqrt(2))
                nn.init.zeros_(module.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """``images``: uint8 (batch, C, H, W)."""
        return torch.relu(self.linear(self.convs(images.float() / 255.0).flatten(1)))


class ObservationReader:
    """The parameter-free half: raw observation batch (tensors, same structure as the space) -> prepared batch."""

    def __init__(self, spec: dict[str, Any]):
        layout = observation_layout(spec)
        self.container, self.parts = layout["container"], layout["parts"]
        self.has_images = any(part["kind"] == "image" for part in self.parts)
        self.flat_box = self.container is None and self.parts[0]["kind"] == "box"
        self.dim = sum(part["dim"] for part in self.parts)
        self.norm_dim = sum(part["dim"] for part in self.parts if part["kind"] == "box")

    def prepare(self, obs: Any, normalise) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Without images a float (batch, dim) tensor; with images a tuple of one tensor per part (vectors encoded,
        images uint8 channels-first). ``normalise(x, start)`` applies the running statistics of the Box columns from
        ``start``."""
        if self.flat_box:
            return normalise(obs.reshape(-1, self.dim).float(), 0)
        leaves = [obs] if self.container is None else [obs[part["key"]] for part in self.parts]
        columns, norm_at = [], 0
        for part, leaf in zip(self.parts, leaves):
            kind = part["kind"]
            rows = leaf.shape[0] if leaf.dim() > len(part["shape"]) else 1
            if kind == "image":
                columns.append(_channels_first(leaf.reshape(rows, *part["shape"]), part["layout"]))
            elif kind == "box":
                columns.append(normalise(leaf.reshape(rows, -1).float(), norm_at))
                norm_at += part["dim"]
            elif kind == "discrete":
                columns.append(nn.functional.one_hot(leaf.reshape(rows).long() - part["start"], part["n"]).float())
            elif kind == "multi_discrete":
                index = leaf.reshape(rows, -1).long() - torch.as_tensor(part["start"], device=leaf.device)
                hots = [nn.functional.one_hot(index[:, j], n) for j, n in enumerate(part["nvec"])]
                columns.append(torch.cat(hots, dim=1).float())
            else:  # multi_binary
                columns.append(leaf.reshape(rows, -1).float())
        if self.has_images:
            return tuple(columns)
        return columns[0] if len(columns) == 1 else torch.cat(columns, dim=1)


def _channels_first(images: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "hwc":
        return images.permute(0, 3, 1, 2)
    if layout == "hw":
        return images.unsqueeze(1)
    return images


class FeatureExtractor(nn.ModuleDict):
    """The learned half: one ``ImageEncoder`` per image part (named by the part's index), the rest passed through."""

    def __init__(self, reader: ObservationReader):
        super().__init__({str(i): ImageEncoder(part) for i, part in enumerate(reader.parts) if part["kind"] == "image"})
        self.reader = reader

    def forward(self, prepared: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        if not self.reader.has_images:
            return prepared
        columns = []
        for i, (part, column) in enumerate(zip(self.reader.parts, prepared)):
            columns.append(self[str(i)](column) if part["kind"] == "image" else column)
        return columns[0] if len(columns) == 1 else torch.cat(columns, dim=1)
