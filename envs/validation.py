"""``validate_env``: gymnasium's checker plus our own checks, reporting every problem at once."""

from __future__ import annotations

import inspect
import warnings

import gymnasium as gym
import numpy as np
from gymnasium.utils.env_checker import check_env

from opentinker.envs.base import EnvLike, env_name, make_env
from opentinker.envs.errors import EnvAPIWarning, EnvSpecError, EnvValidationError
from opentinker.envs.spaces import unsupported_spaces

_STEPS = 64  # long enough to cross a few resets on quick-failing envs, short enough to run before every job
_SEED = 12345
# check_env warnings that are style advice rather than defects (unbounded Box, non-normalised actions, render).
_ADVICE = ("infinity", "symmetric and normalized", "render", "different from the unwrapped", "now ignored")


def _space_problems(where: str, obs: object, space: gym.Space) -> list[str]:
    if isinstance(space, gym.spaces.Dict):
        if not isinstance(obs, dict) or set(obs) != set(space.spaces):
            got = sorted(obs) if isinstance(obs, dict) else type(obs).__name__
            return [f"{where}: observation is {got!r}, expected a dict with keys {sorted(space.spaces)}"]
        return [p for key, sub in space.spaces.items() for p in _space_problems(f"{where}[{key!r}]", obs[key], sub)]
    if isinstance(space, gym.spaces.Tuple):
        if not isinstance(obs, tuple) or len(obs) != len(space.spaces):
            return [f"{where}: observation is {type(obs).__name__}, expected a tuple of {len(space.spaces)}"]
        return [p for i, sub in enumerate(space.spaces) for p in _space_problems(f"{where}[{i}]", obs[i], sub)]
    problems = []
    if isinstance(space, gym.spaces.Box):
        arr = np.asarray(obs)
        if not isinstance(obs, np.ndarray):
            problems.append(f"{where}: observation is {type(obs).__name__}, expected np.ndarray")
        if arr.dtype != space.dtype:
            problems.append(
                f"{where}: observation dtype {arr.dtype} differs from observation_space dtype {space.dtype}"
            )
        if arr.shape != space.shape:
            problems.append(
                f"{where}: observation shape {arr.shape} differs from observation_space shape {space.shape}"
            )
    if not problems and not space.contains(obs):
        problems.append(f"{where}: observation {np.asarray(obs).tolist()!r:.120} is outside observation_space {space}")
    return problems


def _rollout(env: gym.Env, seed: int, actions: list) -> tuple[list, list[str]]:
    """Reset with ``seed``, play ``actions`` (resetting on episode end); observations seen and problems found."""
    problems: list[str] = []
    out = env.reset(seed=seed)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        return [], [f"reset() must return (obs, info: dict), got {type(out).__name__}"]
    obs = out[0]
    seen = [obs]
    problems += _space_problems("reset()", obs, env.observation_space)
    for t, action in enumerate(actions):
        out = env.step(action)
        if not (isinstance(out, tuple) and len(out) == 5):
            return seen, [
                *problems,
                f"step() must return (obs, reward, terminated, truncated, info), got {type(out).__name__}",
            ]
        obs, reward, terminated, truncated, info = out
        problems += _space_problems(f"step() #{t}", obs, env.observation_space)
        if not isinstance(reward, (int, float, np.integer, np.floating)) or isinstance(reward, bool):
            problems.append(f"step() #{t}: reward is {type(reward).__name__}, expected a float")
        for name, flag in (("terminated", terminated), ("truncated", truncated)):
            if not isinstance(flag, (bool, np.bool_)):
                problems.append(f"step() #{t}: {name} is {type(flag).__name__}, expected bool")
        if not isinstance(info, dict):
            problems.append(f"step() #{t}: info is {type(info).__name__}, expected dict")
        seen.append((obs, reward, terminated, truncated))
        if problems:
            break
        if terminated or truncated:
            obs, _ = env.reset()
            seen.append(obs)
    return seen, problems


def _plain(message: object) -> str:
    """Drop the ANSI colour codes gymnasium's logger wraps around warnings."""
    return str(message).replace("\x1b[33m", "").replace("\x1b[0m", "").removeprefix("WARN: ")


def _same(a: object, b: object) -> bool:
    """Equal trajectories: lists of observations / step tuples, compared leaf by leaf (Dict observations too)."""
    if isinstance(a, dict) or isinstance(b, dict):
        return (
            isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (
            isinstance(a, (list, tuple))
            and isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b))
        )
    return np.array_equal(np.asarray(a), np.asarray(b))


def validate_env(env: EnvLike) -> None:
    """Check an env (instance, id, class or factory); raise ``EnvValidationError`` listing every problem.

    Checks: both spaces declared and of a kind the engine trains on (``envs/spaces.py``: else that one line is the only
    problem reported); gymnasium's ``check_env`` (errors and warnings); ``reset``/``step``
    signatures and return shapes; observation dtype/shape against the space and inside it; reward and flag
    types; the same seed and actions giving the same trajectory.
    """
    name = env_name(env)
    try:
        instance = env if isinstance(env, gym.Env) else make_env(env)
    except EnvSpecError as exc:
        raise EnvValidationError(name, [str(exc)]) from exc
    problems: list[str] = []
    for field in ("observation_space", "action_space"):
        if not isinstance(getattr(instance, field, None), gym.spaces.Space):
            problems.append(f"{field} is missing or not a gymnasium.spaces.Space")
    unsupported = None if problems else unsupported_spaces(instance.observation_space, instance.action_space)
    if problems or unsupported:
        raise EnvValidationError(name, problems or [unsupported])
    params = inspect.signature(instance.unwrapped.reset).parameters
    for kw in ("seed", "options"):
        if kw not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            problems.append(f"reset() does not accept the keyword argument {kw!r}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            check_env(instance.unwrapped, skip_render_check=True, skip_close_check=True)
        except Exception as exc:  # the checker raises assorted types; each is a finding, not a crash
            problems.append(f"gymnasium check_env: {type(exc).__name__}: {exc}")
    problems += [
        f"gymnasium check_env warning: {_plain(w.message)}"
        for w in caught
        if issubclass(w.category, UserWarning)
        and not issubclass(w.category, EnvAPIWarning)
        and not any(a in str(w.message) for a in _ADVICE)
    ]
    for w in caught:  # converted old API: advice for the caller, not a defect
        if issubclass(w.category, EnvAPIWarning):
            warnings.warn(w.message, stacklevel=2)
    instance.action_space.seed(_SEED)
    actions = [instance.action_space.sample() for _ in range(_STEPS)]
    try:
        first, found = _rollout(instance, _SEED, actions)
        problems += found
        if not found:
            second, _ = _rollout(instance, _SEED, actions)
            if not _same(first, second):
                problems.append(
                    f"not deterministic: reset(seed={_SEED}) and the same actions gave different trajectories"
                )
    except Exception as exc:
        problems.append(f"reset/step raised {type(exc).__name__}: {exc}")
    if problems:
        raise EnvValidationError(name, list(dict.fromkeys(problems)))
