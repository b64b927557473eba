"""The numpy feature extractor: raw observations -> the float32 matrix the policy heads read.

The twin of ``agents/extractors.py`` (same spec, same weight names, same arithmetic): Box vectors are flattened (and
normalised by the policy's running statistics when the spec says so), Discrete/MultiDiscrete become one-hots,
MultiBinary floats, uint8 images go through the CNN (scaled by 1/255), and the parts of a Dict/Tuple observation are
concatenated in space order. Convolutions are im2col (a strided window view) times the weight matrix: one BLAS call
per layer, fast enough for rollout workers that run it every step.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from opentinker.envs.spaces import legacy_observation_spec

_EPS = np.float32(1e-8)


def observation_layout(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec's ``obs`` field (specs exported before structured observations are read the old way)."""
    return spec["obs"] if "obs" in spec else legacy_observation_spec(spec)


def conv2d_nhwc(x: np.ndarray, matrix: np.ndarray, bias: np.ndarray, kernel: int, stride: int) -> np.ndarray:
    """A valid (unpadded) convolution of NHWC ``x``; ``matrix`` is the torch weight (O, C, k, k) as (C*k*k, O)."""
    windows = sliding_window_view(x, (kernel, kernel), axis=(1, 2))[:, ::stride, ::stride]  # (N, Ho, Wo, C, k, k)
    n, ho, wo = windows.shape[:3]
    out = windows.reshape(n * ho * wo, -1) @ matrix
    out += bias
    return out.reshape(n, ho, wo, -1)


def image_to_nhwc(obs: np.ndarray, layout: str) -> np.ndarray:
    """uint8 images in the env's layout -> float32 NHWC in [0, 1]."""
    x = np.asarray(obs)
    if layout == "chw":
        x = x.transpose(0, 2, 3, 1)
    elif layout == "hw":
        x = x[..., None]
    return x.astype(np.float32) * np.float32(1.0 / 255.0)


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
    """The CNN of one image part: conv + ReLU layers, flatten (in torch's C, H, W order), linear + ReLU."""

    def __init__(self, part: dict[str, Any], weights: dict[str, np.ndarray], prefix: str):
        self.layout, self.layers = part["layout"], []
        for j, (_, kernel, stride) in enumerate(part["convs"]):
            weight, bias = weights[f"{prefix}.convs.{2 * j}.weight"], weights[f"{prefix}.convs.{2 * j}.bias"]
            matrix = np.ascontiguousarray(weight.reshape(weight.shape[0], -1).T)  # (C*k*k, O), im2col's order
            self.layers.append((matrix, bias, kernel, stride))
        self.linear_t = np.ascontiguousarray(weights[f"{prefix}.linear.weight"].T)
        self.linear_b = weights[f"{prefix}.linear.bias"]

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        x = image_to_nhwc(obs, self.layout)
        with single_threaded_blas():
            for matrix, bias, kernel, stride in self.layers:
                x = conv2d_nhwc(x, matrix, bias, kernel, stride)
                np.maximum(x, 0.0, out=x)
            x = x.transpose(0, 3, 1, 2).reshape(x.shape[0], -1)
            out = x @ self.linear_t + self.linear_b
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
