"""``validate_env``: gymnasium's checker plus our own checks, reporting every problem at once."""

from __future__ import annotations

import inspect
import warnings

import gymnasium as gym
import numpy as np
from gymnasium.utils.env_checker import check_env

from opentinker.envs.base import EnvLike, env_name, make_env
from opentinker.envs.errors import EnvAPIWarning, EnvSpecError, EnvValidationError

_STEPS = 64  # long enough to cross a few resets on quick-failing envs, short enough to run before every job
_SEED = 12345
# check_env warnings that are style advice rather than defects (unbounded Box, non-normalised actions, render).
_ADVICE = ("infinity", "symmetric and normalized", "render", "different from the unwrapped", "now ignored")


def _space_problems(where: str, obs: object, space: gym.Space) -> list[str]:
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


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        all(
            np.array_equal(np.asarray(x), np.asarray(y))
            for x, y in zip(ta if isinstance(ta, tuple) else (ta,), tb if isinstance(tb, tuple) else (tb,))
        )
        for ta, tb in zip(a, b)
    )


def validate_env(env: EnvLike) -> None:
    """Check an env (instance, id, class or factory); raise ``EnvValidationError`` listing every problem.

    Checks: both spaces declared; gymnasium's ``check_env`` (errors and warnings); ``reset``/``step``
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
    if problems:
        raise EnvValidationError(name, problems)
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
