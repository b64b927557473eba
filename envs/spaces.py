"""Which gymnasium spaces the engine trains on, and how a policy reads each one (the policy spec's space fields).

Observations: ``Box`` vectors (any shape, flattened), ``Box`` images (uint8 in [0, 255], H x W, H x W x C or
C x H x W: the channel axis is the smallest, as SB3 decides it), ``Discrete``, ``MultiDiscrete``, ``MultiBinary``, and a
``Dict`` or ``Tuple`` of those (one level, as SB3's ``MultiInputPolicy``). Actions: ``Discrete``, ``MultiDiscrete``,
``MultiBinary`` and ``Box``. Text envs (both spaces ``Text``) are GRPO's contract, not the numeric engine's.

Everything here is JSON-able description (the spec travels to rollout workers, exports and servers); torch and numpy
policies build their layers from it. An unsupported space raises ``EnvSpecError`` in one line naming the space.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from opentinker.envs.errors import EnvSpecError

SUPPORTED_OBSERVATIONS = (
    "Box (a vector, or a uint8 image HxW, HxWxC or CxHxW), Discrete, MultiDiscrete, MultiBinary, "
    "or a Dict/Tuple of those"
)
SUPPORTED_ACTIONS = "Discrete, MultiDiscrete, MultiBinary or Box"
MIN_IMAGE_SIDE = 8
"""Smaller uint8 Boxes are read as vectors (normalised by running statistics, not scaled as pixels)."""
NATURE_CNN = [[32, 8, 4], [64, 4, 2], [64, 3, 1]]
"""Mnih et al. (2015): (out channels, kernel, stride) per conv layer, then a 512-unit linear layer."""
NATURE_MIN_SIDE = 36
"""Smaller images, where the Nature CNN's strides leave nothing, get no convolutions: their pixels, scaled by 1/255,
go through one linear + ReLU layer of ``SMALL_IMAGE_FEATURES`` (what SB3's ``MlpPolicy`` does with them). Measured on
``bench_envs:CatchEnv`` (16 x 16) at 100k steps, 2 seeds: greedy 0.84 / 0.92 in 14 s as a vector, 0.28 / 0.56 in 46 s
through a compact CNN (two 3x3 stride-2 layers; SB3 0.68 / 1.00 in 62 / 77 s); docs/pipeline.md."""
SMALL_IMAGE_FEATURES = 256


def short(space: gym.Space, limit: int = 80) -> str:
    text = str(space)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def image_layout(space: gym.Space) -> str | None:
    """ "hw", "hwc" or "chw" for a uint8 [0, 255] Box of 2 or 3 dims, each side >= ``MIN_IMAGE_SIDE``; else None."""
    if not (isinstance(space, gym.spaces.Box) and space.dtype == np.uint8 and len(space.shape) in (2, 3)):
        return None
    if not (np.all(space.low == 0) and np.all(space.high == 255)):
        return None
    shape = space.shape
    if len(shape) == 2:
        layout, sides = "hw", shape
    elif int(np.argmin(shape)) == 0:
        layout, sides = "chw", shape[1:]
    else:
        layout, sides = "hwc", shape[:2]
    return layout if min(sides) >= MIN_IMAGE_SIDE else None


def conv_output_side(side: int, convs: list[list[int]]) -> int:
    for _, kernel, stride in convs:
        side = (side - kernel) // stride + 1
    return side


def _image_part(space: gym.spaces.Box, layout: str) -> dict[str, Any]:
    shape = space.shape
    if layout == "hw":
        (height, width), channels = shape, 1
    elif layout == "hwc":
        height, width, channels = shape
    else:
        channels, height, width = shape
    convs, features = (NATURE_CNN, 512) if min(height, width) >= NATURE_MIN_SIDE else ([], SMALL_IMAGE_FEATURES)
    flat = (convs[-1][0] if convs else channels) * conv_output_side(height, convs) * conv_output_side(width, convs)
    return {
        "kind": "image",
        "shape": list(shape),
        "layout": layout,
        "height": int(height),
        "width": int(width),
        "channels": int(channels),
        "convs": convs,
        "conv_flat": int(flat),
        "dim": features,
    }


def _part(space: gym.Space, where: str) -> dict[str, Any]:
    """How the policy reads one non-container observation space; ``dim`` is the width it contributes to features."""
    if isinstance(space, gym.spaces.Box):
        layout = image_layout(space)
        if layout is not None:
            return _image_part(space, layout)
        if space.dtype == np.uint8 and len(space.shape) > 3 and np.all(space.low == 0) and np.all(space.high == 255):
            raise EnvSpecError(
                f"{where} {short(space)}: a uint8 image must be 2-D (HxW) or 3-D (HxWxC or CxHxW); "
                "stack frames along the channel axis"
            )
        return {"kind": "box", "shape": list(space.shape), "dim": int(np.prod(space.shape, dtype=np.int64))}
    if isinstance(space, gym.spaces.Discrete):
        return {"kind": "discrete", "shape": [], "n": int(space.n), "start": int(space.start), "dim": int(space.n)}
    if isinstance(space, gym.spaces.MultiDiscrete):
        nvec = space.nvec.reshape(-1)
        return {
            "kind": "multi_discrete",
            "shape": list(space.shape),
            "nvec": nvec.tolist(),
            "start": np.asarray(space.start).reshape(-1).tolist(),
            "dim": int(nvec.sum()),
        }
    if isinstance(space, gym.spaces.MultiBinary):
        return {"kind": "multi_binary", "shape": list(space.shape), "dim": int(np.prod(space.shape, dtype=np.int64))}
    if isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple)):
        raise EnvSpecError(
            f"{where} {short(space)}: nested Dict/Tuple observations are not supported; "
            f"expected {SUPPORTED_OBSERVATIONS}"
        )
    raise EnvSpecError(f"{where} {short(space)} is not supported: expected {SUPPORTED_OBSERVATIONS}")


def observation_spec(space: gym.Space) -> dict[str, Any]:
    """``{"container": None | "dict" | "tuple", "parts": [...]}``: each part a leaf space as ``_part`` reads it, with
    its ``key`` (dict key, tuple index, or None for a plain space)."""
    if isinstance(space, gym.spaces.Dict):
        if not space.spaces:
            raise EnvSpecError("observation_space Dict() is empty: expected at least one sub-space")
        parts = [{"key": key, **_part(sub, f"observation_space[{key!r}]")} for key, sub in space.spaces.items()]
        return {"container": "dict", "parts": parts}
    if isinstance(space, gym.spaces.Tuple):
        if not space.spaces:
            raise EnvSpecError("observation_space Tuple() is empty: expected at least one sub-space")
        parts = [{"key": i, **_part(sub, f"observation_space[{i}]")} for i, sub in enumerate(space.spaces)]
        return {"container": "tuple", "parts": parts}
    return {"container": None, "parts": [{"key": None, **_part(space, "observation_space")}]}


def legacy_observation_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``obs`` field of a spec from before structured observations (``obs_kind``/``obs_shape``/``obs_dim``)."""
    if spec["obs_kind"] == "discrete":
        part = {"kind": "discrete", "shape": [], "n": spec["obs_dim"], "start": 0, "dim": spec["obs_dim"]}
    else:
        part = {"kind": "box", "shape": list(spec["obs_shape"]), "dim": spec["obs_dim"]}
    return {"container": None, "parts": [{"key": None, **part}]}


def action_spec(space: gym.Space, value_based: bool, actor: str | None = None) -> dict[str, Any]:
    """The action head for ``space``: ``kind`` and what it needs. ``value_based``: a Q network (Discrete only).
    ``actor`` picks a Box head other than PPO's Gaussian: "squashed_gaussian" (SAC) or "deterministic" (TD3)."""
    if value_based and not isinstance(space, gym.spaces.Discrete):
        raise EnvSpecError(f"action_space {short(space)} is not supported by this algorithm: expected Discrete")
    if actor is not None and not isinstance(space, gym.spaces.Box):
        raise EnvSpecError(f"action_space {short(space)} is not supported by this algorithm: expected a Box")
    if isinstance(space, gym.spaces.Discrete):
        return {
            "kind": "q" if value_based else "categorical",
            "action_dim": int(space.n),
            "action_start": int(space.start),
        }
    if isinstance(space, gym.spaces.MultiDiscrete):
        nvec = space.nvec.reshape(-1)
        return {
            "kind": "multi_categorical",
            "action_dim": int(nvec.sum()),
            "action_nvec": nvec.tolist(),
            "action_start": np.asarray(space.start).reshape(-1).tolist(),
            "action_shape": list(space.shape),
        }
    if isinstance(space, gym.spaces.MultiBinary):
        return {
            "kind": "bernoulli",
            "action_dim": int(np.prod(space.shape, dtype=np.int64)),
            "action_shape": list(space.shape),
        }
    if isinstance(space, gym.spaces.Box):
        if not (np.all(np.isfinite(space.low)) and np.all(np.isfinite(space.high))):
            raise EnvSpecError(f"action_space {short(space)}: continuous actions need finite low/high bounds")
        if actor not in (None, "squashed_gaussian", "deterministic"):
            raise EnvSpecError(f"actor must be None, 'squashed_gaussian' or 'deterministic', got {actor!r}")
        return {
            "kind": actor or "gaussian",
            "action_dim": int(np.prod(space.shape, dtype=np.int64)),
            "action_shape": list(space.shape),
            "action_low": space.low.reshape(-1).astype(np.float64).tolist(),
            "action_high": space.high.reshape(-1).astype(np.float64).tolist(),
        }
    raise EnvSpecError(f"action_space {short(space)} is not supported: expected {SUPPORTED_ACTIONS}")


def unsupported_spaces(observation_space: gym.Space, action_space: gym.Space) -> str | None:
    """One line saying which space the engine cannot train on and what it takes; None when it can (a text env,
    both spaces ``Text``, is fine: GRPO trains it)."""
    is_text = [isinstance(s, gym.spaces.Text) for s in (observation_space, action_space)]
    if all(is_text):
        return None
    if any(is_text):
        return (
            f"observation_space {short(observation_space)} with action_space {short(action_space)} is not supported: "
            "a text env (GRPO) needs both spaces Text; numeric algorithms take observations "
            f"{SUPPORTED_OBSERVATIONS} and actions {SUPPORTED_ACTIONS}"
        )
    try:
        observation_spec(observation_space)
        action_spec(action_space, value_based=False)
    except EnvSpecError as exc:
        return str(exc)
    return None
