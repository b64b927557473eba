"""Export a trained policy as ``policy.json`` + ``weights.npz`` and load it back as a numpy-only policy.

The export needs neither torch nor the training code to run: serving, federated clients and MLflow pyfunc
models all load it with ``load_policy``.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from opentinker.agents.evaluation import ACTIONS, DETERMINISTIC_KINDS, EvalResult, evaluate_served
from opentinker.envs.numpy_policy import ACTOR_ONLY, NumpyPolicy
from opentinker.envs.observations import stack_obs
from opentinker.infra.files import atomic_write

FORMAT_VERSION = 2
"""2: structured observations (``architecture["obs"]``) and every action kind; version 1 exports still load."""
READABLE_VERSIONS = (1, 2)
SPEC_FILE, WEIGHTS_FILE = "policy.json", "weights.npz"
MAX_WEIGHTS_BYTES = 512 << 20
"""The most bytes an export's arrays may hold together: 128 M float32 parameters, hidden layers of 8192 and more (the
zoo's largest policy, Atari's nature CNN, holds 1.7 M). An export may come from a tenant's job and the processes that
load it (the attempt, serving, the API) are trusted: ``read_weights`` refuses more before it allocates."""
MAX_ARRAYS = 1024
"""Arrays in one ``weights.npz`` (a policy holds a few per layer)."""
_END = struct.Struct("<4s4H2LH")
"""A zip's end-of-central-directory record, as ``np.savez`` (Python's ``zipfile``) writes it: no comment, no zip64."""
SERVED_ACTION = "served_action"
"""The ``policy.json`` field naming what the policy serves, ``greedy`` (absent: an export made before it) or
``sampled``: chosen from the candidate's evaluation before it is registered (``record_served_action``)."""


def space_to_json(space: gym.Space) -> dict[str, Any]:
    """A space as JSON (the export's and the service's description of what the policy takes and returns)."""
    if isinstance(space, gym.spaces.Discrete):
        return {"type": "Discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, gym.spaces.MultiDiscrete):
        return {"type": "MultiDiscrete", "nvec": space.nvec.tolist(), "start": np.asarray(space.start).tolist()}
    if isinstance(space, gym.spaces.MultiBinary):
        return {"type": "MultiBinary", "n": np.asarray(space.n).tolist()}
    if isinstance(space, gym.spaces.Dict):
        return {"type": "Dict", "spaces": {key: space_to_json(sub) for key, sub in space.spaces.items()}}
    if isinstance(space, gym.spaces.Tuple):
        return {"type": "Tuple", "spaces": [space_to_json(sub) for sub in space.spaces]}
    if isinstance(space, gym.spaces.Box):
        return {
            "type": "Box",
            "low": space.low.tolist(),
            "high": space.high.tolist(),
            "shape": list(space.shape),
            "dtype": str(space.dtype),
        }
    raise ValueError(f"cannot export space {space}: expected Box, Discrete, MultiDiscrete, MultiBinary, Dict or Tuple")


def space_from_json(data: dict[str, Any]) -> gym.Space:
    kind = data["type"]
    if kind == "Discrete":
        return gym.spaces.Discrete(data["n"], start=data.get("start", 0))
    if kind == "MultiDiscrete":
        return gym.spaces.MultiDiscrete(np.array(data["nvec"]), start=np.array(data["start"]))
    if kind == "MultiBinary":
        return gym.spaces.MultiBinary(data["n"])
    if kind == "Dict":
        return gym.spaces.Dict({key: space_from_json(sub) for key, sub in data["spaces"].items()})
    if kind == "Tuple":
        return gym.spaces.Tuple([space_from_json(sub) for sub in data["spaces"]])
    if data["type"] == "Box":
        dtype, shape = np.dtype(data["dtype"]), tuple(data["shape"])
        low, high = np.array(data["low"], dtype), np.array(data["high"], dtype)
        if low.shape != shape or high.shape != shape:  # a scalar bound would be broadcast to whatever shape says
            raise ValueError(f"Box space in policy.json: low and high must each hold shape {shape[:8]}")
        return gym.spaces.Box(low, high, shape, dtype)
    raise ValueError(f"unknown space type {data['type']!r} in policy.json")


def _leaf_batch(space: gym.Space, value: Any, where: str) -> np.ndarray:
    dtype = np.int64 if isinstance(space, gym.spaces.Discrete) else space.dtype
    obs = np.asarray(value, dtype=dtype)
    if obs.ndim == 0 or obs.shape[1:] != space.shape:
        expected = f"(batch, {', '.join(map(str, space.shape))})" if space.shape else "(batch,)"
        raise ValueError(f"{where} batch has shape {obs.shape}; expected {expected}")
    return obs


def observation_batch(space: gym.Space, value: Any) -> Any:
    """A batch of observations as the numpy policy takes it, checked against ``space`` (a ``ValueError`` names the
    part at fault). Dict/Tuple spaces take a dict/tuple of batched arrays, or a list of single observations."""
    if isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple)):
        container = dict if isinstance(space, gym.spaces.Dict) else tuple
        if isinstance(value, list):
            if not value:
                raise ValueError("observation batch is empty")
            value = stack_obs([_as_container(space, item, f"observation [{i}]") for i, item in enumerate(value)])
        value = _as_container(space, value, "observation batch")
        keys = space.spaces.keys() if container is dict else range(len(space.spaces))
        batch = [_leaf_batch(space.spaces[k], value[k], f"observation[{k!r}]") for k in keys]
        if len({len(leaf) for leaf in batch}) != 1:
            raise ValueError(f"observation batch parts have different lengths: {[len(leaf) for leaf in batch]}")
        return dict(zip(keys, batch)) if container is dict else tuple(batch)
    return _leaf_batch(space, value, "observation")


def _as_container(space: gym.Space, value: Any, where: str) -> Any:
    if isinstance(space, gym.spaces.Dict):
        if not isinstance(value, dict) or set(value) != set(space.spaces):
            got = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise ValueError(f"{where} is {got!r}; expected a dict with keys {sorted(space.spaces)}")
        return value
    if not isinstance(value, (tuple, list)) or len(value) != len(space.spaces):
        raise ValueError(f"{where} is {type(value).__name__}; expected a tuple of {len(space.spaces)} parts")
    return tuple(value)


def actions_inside(space: gym.Space, actions: np.ndarray) -> bool:
    """Vectorised ``space.contains`` over a batch of actions (the serving hot path)."""
    if isinstance(space, gym.spaces.Box):
        return actions.shape[1:] == space.shape and bool(np.all((actions >= space.low) & (actions <= space.high)))
    if isinstance(space, gym.spaces.Discrete):
        return bool(np.all((actions >= space.start) & (actions < space.start + space.n)))
    if isinstance(space, gym.spaces.MultiDiscrete):
        inside = (actions >= space.start) & (actions < space.start + space.nvec)
        return actions.shape[1:] == space.shape and bool(np.all(inside))
    return actions.shape[1:] == space.shape and bool(np.all((actions == 0) | (actions == 1)))  # MultiBinary


class InferencePolicy:
    """A loaded export: numpy forward only; ``act`` answers the action the export serves (``served_action``: the
    greedy / mean action, or a draw from the policy's distribution where that evaluated clearly better)."""

    def __init__(self, spec: dict[str, Any], weights: dict[str, np.ndarray]):
        self.spec = spec
        self.observation_space = space_from_json(spec["observation_space"])
        self.action_space = space_from_json(spec["action_space"])
        self._net = NumpyPolicy(spec["architecture"], weights)
        self.served_action = spec.get(SERVED_ACTION, "greedy")
        if self.served_action not in ACTIONS or (
            self.served_action == "sampled" and self._net.kind in DETERMINISTIC_KINDS
        ):
            raise ValueError(f"policy.json: {SERVED_ACTION} {self.served_action!r} for a {self._net.kind} policy")
        self._deterministic = self.served_action == "greedy"

    def act(self, obs_batch: Any) -> np.ndarray:
        """Env-ready actions, one per observation of ``obs_batch`` (arrays shaped (batch, *space shape); for
        Dict/Tuple spaces a dict/tuple of them or a list of observations): continuous actions are clipped or scaled to
        the action space, and every action is checked to lie in it."""
        obs = observation_batch(self.observation_space, obs_batch)
        actions = self._net.act(obs, deterministic=self._deterministic)
        self._check_actions(actions)
        return actions

    def _check_actions(self, actions: np.ndarray) -> None:
        if not actions_inside(self.action_space, actions):
            raise ValueError(f"policy produced actions outside {self.action_space}: {actions.tolist()!r:.200}")

    def act_with_info(self, obs_batch: Any) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Actions plus action probabilities (discrete actor-critic) and state values (actor-critic)."""
        obs = observation_batch(self.observation_space, obs_batch)
        rng = None if self._deterministic else np.random.default_rng()
        actions, _, values = self._net.sample(obs, rng, deterministic=self._deterministic)
        actions = self._net.env_actions(actions)
        self._check_actions(actions)
        has_values = self._net.kind not in ("q", *ACTOR_ONLY)
        return actions, self._net.probs(obs), values if has_values else None

    def evaluate(self, env: Any, episodes: int = 10, seed: int = 10_000) -> EvalResult:
        """Episodes seeded ``seed + i`` acting as served, the other action beside it where the policy is stochastic
        (``evaluation.evaluate_served``; sampled actions drawn reproducibly from ``seed``)."""
        return evaluate_served(self._net, self.served_action, env, episodes, seed)


def _policy_parts(trainer_or_policy: Any) -> tuple[Any, str, str | None, gym.Space, gym.Space]:
    """(torch policy, algorithm, env id, observation space, action space) from a trainer or a bare policy."""
    if hasattr(trainer_or_policy, "policy") and hasattr(trainer_or_policy, "algorithm"):
        t = trainer_or_policy
        return t.policy, t.algorithm, t.env_id, t.observation_space, t.action_space
    policy = trainer_or_policy
    spaces = getattr(policy, "observation_space", None), getattr(policy, "action_space", None)
    if spaces[0] is None:
        raise ValueError("export_policy needs a trainer, or a policy with observation_space/action_space attributes")
    algorithm = {"q": "dqn", "squashed_gaussian": "sac", "deterministic": "td3"}.get(policy.spec["kind"], "ppo")
    return policy, algorithm, None, *spaces


def export_policy(trainer_or_policy: Any, directory: str | os.PathLike, metadata: dict | None = None) -> Path:
    """Write ``policy.json`` (architecture, spaces, algorithm, env id, metadata) and ``weights.npz``."""
    policy, algorithm, env_id, obs_space, act_space = _policy_parts(trainer_or_policy)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    spec = {
        "format_version": FORMAT_VERSION,
        "algorithm": algorithm,
        "env_id": env_id,
        "architecture": policy.spec,
        "observation_space": space_to_json(obs_space),
        "action_space": space_to_json(act_space),
        "metadata": dict(metadata or {}),
    }
    json.dumps(spec)  # fail here, before writing, if metadata is not JSON-able
    for name, write in (
        (WEIGHTS_FILE, lambda fh: np.savez(fh, **policy.numpy_weights())),
        (SPEC_FILE, lambda fh: fh.write(json.dumps(spec, indent=2).encode())),
    ):
        atomic_write(directory / name, write)
    return directory


def record_served_action(directory: str | os.PathLike, action: str) -> None:
    """Write ``action`` into the export's ``policy.json``: what serving, evaluations and the gate will use."""
    if action not in ACTIONS:
        raise ValueError(f"served action must be one of {ACTIONS}, got {action!r}")
    path = Path(directory) / SPEC_FILE
    spec = json.loads(path.read_text())
    atomic_write(path, json.dumps({**spec, SERVED_ACTION: action}, indent=2))


def load_policy(directory: str | os.PathLike) -> InferencePolicy:
    directory = Path(directory)
    spec_path = directory / SPEC_FILE
    if not spec_path.is_file():
        raise FileNotFoundError(f"no {SPEC_FILE} in {directory}: not a policy export")
    spec = json.loads(spec_path.read_text())
    if spec.get("format_version") not in READABLE_VERSIONS:
        raise ValueError(
            f"{spec_path}: format_version {spec.get('format_version')!r}, expected one of {READABLE_VERSIONS}"
        )
    return InferencePolicy(spec, read_weights(directory / WEIGHTS_FILE))


class WeightsError(ValueError):
    """A ``weights.npz`` that is not what ``export_policy`` writes, or declares more than ``MAX_WEIGHTS_BYTES``."""


def read_weights(path: Path, max_bytes: int = MAX_WEIGHTS_BYTES) -> dict[str, np.ndarray]:
    """The arrays of an export's ``weights.npz`` (``np.load`` without pickle, bounded): the zip's directory, each
    member's ``.npy`` header (shape, dtype) and its real size are checked against the limits before any array is
    allocated, so a small file declaring a GiB costs nothing. Every trusted load of an export goes through here."""
    with path.open("rb") as handle:
        handle.seek(0, os.SEEK_END)
        if handle.tell() < _END.size:
            raise WeightsError(f"{WEIGHTS_FILE}: not a zip archive")
        handle.seek(-_END.size, os.SEEK_END)
        signature, _, _, _, entries, directory_size, _, comment = _END.unpack(handle.read(_END.size))
        if signature != b"PK\x05\x06" or comment or entries > MAX_ARRAYS or directory_size > MAX_ARRAYS * 1024:
            raise WeightsError(f"{WEIGHTS_FILE}: not an archive of at most {MAX_ARRAYS} arrays as np.savez writes it")
        try:
            with zipfile.ZipFile(handle) as archive:
                return _bounded_arrays(archive, max_bytes)
        except WeightsError:
            raise
        except (zipfile.BadZipFile, zlib.error, EOFError, ValueError) as exc:  # a corrupt member, a bad CRC, cut short
            raise WeightsError(f"{WEIGHTS_FILE}: not a readable archive of arrays ({str(exc)[:100]})") from None


def _bounded_arrays(archive: zipfile.ZipFile, max_bytes: int) -> dict[str, np.ndarray]:
    """Every member's header checked (its declared size against ``max_bytes`` and against its real size), then read."""
    members, declared = [], 0
    for info in archive.infolist():
        with archive.open(info) as member:
            shape, dtype, header = _npy_header(info.filename, member)
        size = math.prod(shape) * dtype.itemsize
        declared += size
        if declared > max_bytes:
            raise WeightsError(
                f"{WEIGHTS_FILE}: member {info.filename!r} declares {size} bytes {shape[:8]} {dtype}, "
                f"taking the arrays past {max_bytes} bytes"
            )
        if info.file_size != header + size:
            raise WeightsError(
                f"{WEIGHTS_FILE}: member {info.filename!r} declares {size} bytes of data but holds "
                f"{info.file_size - header}"
            )
        members.append(info)
    weights = {}
    for info in members:
        with archive.open(info) as member:
            weights[info.filename.removesuffix(".npy")] = np.lib.format.read_array(member, allow_pickle=False)
    return weights


def _npy_header(name: str, member: Any) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, header bytes) of one ``.npy`` member, read without reading its data."""
    if not name.endswith(".npy") or len(name) > 256:
        raise WeightsError(f"{WEIGHTS_FILE}: member {name[:100]!r} is not an array (.npy)")
    try:
        version = np.lib.format.read_magic(member)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(member)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(member)
        else:
            raise ValueError(f"format version {version}")
    except ValueError as exc:
        raise WeightsError(f"{WEIGHTS_FILE}: member {name!r} has no readable .npy header ({str(exc)[:100]})") from None
    if dtype.hasobject:
        raise WeightsError(f"{WEIGHTS_FILE}: member {name!r} holds Python objects")
    return shape, dtype, member.tell()
