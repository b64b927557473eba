"""The numpy feature extractor: raw observations -> the float32 matrix the policy heads read.

The twin of ``agents/extractors.py`` (same spec, same weight names, same arithmetic): Box vectors are flattened (and
normalised by the policy's running statistics when the spec says so), Discrete/MultiDiscrete become one-hots,
MultiBinary floats, uint8 images go through the CNN (scaled by 1/255), and the parts of a Dict/Tuple observation are
concatenated in space order. Convolutions are im2col (a strided window view) times the weight matrix: one BLAS call
per layer, fast enough for rollout workers that run it every step (``Conv2d``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from opentinker.envs.spaces import conv_output_side, legacy_observation_spec

_EPS = np.float32(1e-8)


def observation_layout(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec's ``obs`` field (specs exported before structured observations are read the old way)."""
    return spec["obs"] if "obs" in spec else legacy_observation_spec(spec)


class Conv2d:
    """A valid (unpadded) convolution + ReLU of an NHWC batch as one matrix product (im2col).

    The windows are gathered in NHWC memory order (kernel rows, kernel columns, channels), so each copied run is a
    pixel's channels. When the stride divides the kernel (the Nature CNN's 8/4 and 4/2) the image is first cut into
    stride x stride blocks stacked as channels (space-to-depth): the convolution becomes a stride-1 one over longer
    contiguous runs, half the time of the first Atari layer. ``scale`` folds the first layer's 1/255 into its weights,
    so uint8 pixels are gathered as bytes and converted once.
    """

    def __init__(self, weight: np.ndarray, bias: np.ndarray, stride: int, scale: float = 1.0):
        out, channels, kernel, _ = weight.shape
        self.kernel, self.stride, self.bias = kernel, stride, bias
        matrix = weight.transpose(2, 3, 1, 0)  # (k, k, C, O)
        self.blocked = stride > 1 and kernel % stride == 0
        if self.blocked:  # rows ordered (block row, block column, row in block, column in block, channel)
            kb = kernel // stride
            matrix = matrix.reshape(kb, stride, kb, stride, channels, out).transpose(0, 2, 1, 3, 4, 5)
        self.matrix = np.ascontiguousarray(matrix.reshape(-1, out) * np.float32(scale))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        kernel, stride = self.kernel, self.stride
        if self.blocked:
            n, height, width, channels = x.shape
            hb, wb, s = height // stride, width // stride, stride
            x = x[:, : hb * s, : wb * s].reshape(n, hb, s, wb, s, channels).transpose(0, 1, 3, 2, 4, 5)
            x = x.reshape(n, hb, wb, s * s * channels)
            kernel, stride = kernel // s, 1
        windows = sliding_window_view(x, (kernel, kernel), axis=(1, 2))[:, ::stride, ::stride]
        windows = windows.transpose(0, 1, 2, 4, 5, 3)  # (N, Ho, Wo, k, k, C)
        n, ho, wo = windows.shape[:3]
        out = windows.reshape(n * ho * wo, -1).astype(np.float32, copy=False) @ self.matrix
        out += self.bias
        np.maximum(out, 0.0, out=out)
        return out.reshape(n, ho, wo, -1)


def image_nhwc(obs: Any, layout: str) -> np.ndarray:
    """uint8 images in the env's layout -> an NHWC view (still uint8)."""
    x = np.asarray(obs)
    if layout == "chw":
        return x.transpose(0, 2, 3, 1)
    return x[..., None] if layout == "hw" else x


@functools.cache
def _blas_threads():
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def single_threaded_blas():
    """One BLAS thread for the CNN's matrix products (~20 us to enter). They are just big enough for OpenBLAS to
    start its threads, which spin against the env loop and the other workers: on a busy 2-core machine a 16x16 image
    batch took 7x longer with them (one worker per core is the rollout's parallelism)."""
    return _blas_threads().limit(limits=1, user_api="blas")


class ImageFeatures:
    """The CNN of one image part: conv + ReLU layers, flatten, linear + ReLU (torch's ``ImageEncoder``)."""

    def __init__(self, part: dict[str, Any], weights: dict[str, np.ndarray], prefix: str):
        self.layout, self.convs = part["layout"], []
        for j, (_, _, stride) in enumerate(part["convs"]):
            weight, bias = weights[f"{prefix}.convs.{2 * j}.weight"], weights[f"{prefix}.convs.{2 * j}.bias"]
            self.convs.append(Conv2d(weight, bias, stride, scale=1.0 / 255.0 if j == 0 else 1.0))
        # torch flattens (C, H, W); the columns are permuted once so the NHWC output flattens as it lies in memory.
        linear = weights[f"{prefix}.linear.weight"]
        channels = part["convs"][-1][0] if part["convs"] else part["channels"]
        sides = [conv_output_side(part[side], part["convs"]) for side in ("height", "width")]
        linear = linear.reshape(-1, channels, *sides).transpose(0, 2, 3, 1).reshape(linear.shape[0], -1)
        self.linear_t = np.ascontiguousarray(linear.T if self.convs else linear.T / np.float32(255.0))  # pixels in
        self.linear_b = weights[f"{prefix}.linear.bias"]

    def __call__(self, obs: Any) -> np.ndarray:
        x = image_nhwc(obs, self.layout)
        with single_threaded_blas():
            for conv in self.convs:
                x = conv(x)
            out = x.reshape(x.shape[0], -1) @ self.linear_t
        out += self.linear_b
        return np.maximum(out, 0.0, out=out)


def one_hot(index: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros((index.shape[0], n), dtype=np.float32)
    out[np.arange(index.shape[0]), index] = 1.0
    return out


class NumpyFeatures:
    """``features(obs_batch) -> (batch, dim)`` float32, per the spec's observation parts."""

    def __init__(self, spec: dict[str, Any], weights: dict[str, np.ndarray]):
        layout = observation_layout(spec)
        self.container, self.parts = layout["container"], layout["parts"]
        self.dim = sum(part["dim"] for part in self.parts)
        self.norm_clip = spec["obs_norm"]["clip"] if "obs_norm" in spec else None
        if self.norm_clip is not None:
            self.norm_mean, self.norm_var = weights["obs_mean"], weights["obs_var"]
        first = self.parts[0]
        # The fast path: one Box vector (CartPole, MuJoCo): reshape, normalise, done.
        self.flat_box = self.container is None and first["kind"] == "box"
        self.images = {
            i: ImageFeatures(part, weights, f"features.{i}")
            for i, part in enumerate(self.parts)
            if part["kind"] == "image"
        }

    def _normalise(self, x: np.ndarray, start: int) -> np.ndarray:
        if self.norm_clip is None:
            return x
        end = start + x.shape[1]
        x = (x - self.norm_mean[start:end]) / np.sqrt(self.norm_var[start:end] + _EPS)
        return np.clip(x, -self.norm_clip, self.norm_clip)

    def __call__(self, obs: Any) -> np.ndarray:
        if self.flat_box:
            x = np.asarray(obs, dtype=np.float32).reshape(-1, self.dim)
            return x if self.norm_clip is None else self._normalise(x, 0)
        leaves = [obs] if self.container is None else [obs[part["key"]] for part in self.parts]
        columns, norm_at = [], 0
        for i, (part, leaf) in enumerate(zip(self.parts, leaves)):
            kind = part["kind"]
            if kind == "image":
                columns.append(self.images[i](leaf))
                continue
            leaf = np.asarray(leaf)
            rows = leaf.shape[0] if leaf.ndim > len(part["shape"]) else 1
            if kind == "box":
                columns.append(self._normalise(leaf.astype(np.float32).reshape(rows, -1), norm_at))
                norm_at += part["dim"]
            elif kind == "discrete":
                columns.append(one_hot(leaf.reshape(rows).astype(np.int64) - part["start"], part["n"]))
            elif kind == "multi_discrete":
                index = leaf.reshape(rows, -1).astype(np.int64) - np.asarray(part["start"], np.int64)
                columns += [one_hot(index[:, j], n) for j, n in enumerate(part["nvec"])]
            else:  # multi_binary
                columns.append(leaf.astype(np.float32).reshape(rows, -1))
        return columns[0] if len(columns) == 1 else np.concatenate(columns, axis=1)
