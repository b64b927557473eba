"""``BaseEnv`` (spaces checked at construction) and ``make_env`` (one way to build an env from anything)."""

from __future__ import annotations

import copy
import functools
import importlib
from collections.abc import Callable
from typing import Any, NamedTuple

import gymnasium as gym

from opentinker.envs.atari import is_atari, make_atari, register_ale
from opentinker.envs.errors import EnvSpecError
from opentinker.envs.mujoco_log import route_mujoco_warnings

EnvLike = str | type[gym.Env] | Callable[[], gym.Env] | gym.Env


def check_spaces(env: gym.Env) -> None:
    name = type(env).__name__
    for field in ("observation_space", "action_space"):
        space = getattr(env, field, None)
        if space is None:
            raise EnvSpecError(f"{name}.{field} is missing: set it in __init__ to a gymnasium.spaces.Space")
        if not isinstance(space, gym.spaces.Space):
            raise EnvSpecError(f"{name}.{field} must be a gymnasium.spaces.Space, got {type(space).__name__}")


def after_init(cls: type, hook: Callable[[Any], None]) -> None:
    """Make ``hook(self)`` run once the most-derived ``__init__`` of ``cls`` returns (for ``__init_subclass__``):
    a base class can check or start what its subclass built, whatever the subclass's own ``__init__`` does."""
    original = cls.__dict__.get("__init__")
    if original is None:
        return

    @functools.wraps(original)
    def init_then_hook(self, *args: Any, **kw: Any) -> None:
        original(self, *args, **kw)
        if type(self).__init__ is init_then_hook:  # only the outermost __init__ runs the hook
            hook(self)

    cls.__init__ = init_then_hook  # type: ignore[method-assign]


class BaseEnv(gym.Env):
    """A gymnasium.Env whose subclasses must declare ``observation_space`` and ``action_space``.

    The check runs right after the most-derived ``__init__`` returns, so a missing or wrongly typed space
    fails at construction (``EnvSpecError`` naming the class and the field) rather than deep inside training.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        after_init(cls, check_spaces)


class EnvSpaces(NamedTuple):
    """An env as a trainer without env copies knows it (a name and its spaces): pass it as ``env``, and its owner
    collects rollouts and calls ``update(rollout)`` (a multi-agent kind, a data-parallel learner)."""

    env_id: str
    observation_space: gym.Space
    action_space: gym.Space


def import_env(ref: str) -> EnvLike:
    """``"package.module:Name"`` -> the env class or factory it names; other strings (gymnasium ids, including
    gymnasium's own ``"module:Env-v0"`` form) are returned unchanged. The module must be importable here."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr.isidentifier():
        return ref
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvSpecError(
            f"env {ref!r}: cannot import module {module_name!r} ({exc}); install the package or put it on PYTHONPATH"
        ) from exc
    found = getattr(module, attr, None)
    if found is None:
        return ref  # gymnasium's "module:EnvId" (the import registered the id)
    if not callable(found):
        raise EnvSpecError(
            f"env {ref!r}: {attr} is a {type(found).__name__}, expected a gymnasium.Env class or factory"
        )
    return found


def env_spec(env_id: str) -> gym.envs.registration.EnvSpec:
    """The registry spec of a gymnasium id, without building the env; Atari's ids are registered first. An unknown id
    raises ``EnvSpecError`` with gymnasium's hint (``Did you mean: `CartPole`?``, ``Please use `Taxi-v4` instead``)."""
    if is_atari(env_id):
        register_ale()
    try:
        return gym.spec(env_id)
    except gym.error.Error as exc:  # NameNotFound, VersionNotFound, DeprecatedEnv, NamespaceNotFound, ...
        raise EnvSpecError(f"env id {env_id!r} is not a registered gymnasium env: {exc}") from exc


def make_env(env: EnvLike, **kwargs: Any) -> gym.Env:
    """Build one env from a registered id, a ``module:Class``/``module:factory`` path, an env class, a zero-arg
    factory, or (copied) an env instance. Atari ids (``ALE/...``) come preprocessed (``envs/atari.py``)."""
    if isinstance(env, str) and (target := import_env(env)) is not env:
        return make_env(target, **kwargs)
    if is_atari(env):
        made = make_atari(env, **kwargs)
    elif isinstance(env, str):
        route_mujoco_warnings(env_spec(env))
        made = gym.make(env, **kwargs)
    elif isinstance(env, gym.Env):
        if kwargs:
            raise EnvSpecError(
                f"env instance {type(env).__name__} given with kwargs {sorted(kwargs)}: pass the class instead"
            )
        made = copy.deepcopy(env)
    elif callable(env):
        made = env(**kwargs)
        if not isinstance(made, gym.Env):
            raise EnvSpecError(
                f"env factory {getattr(env, '__name__', env)!r} returned {type(made).__name__}, "
                "expected a gymnasium.Env"
            )
    else:
        raise EnvSpecError(
            f"env must be an id, a gymnasium.Env class, a factory or an instance; got {type(env).__name__}"
        )
    check_spaces(made)
    return made


def env_name(env: EnvLike) -> str:
    """A readable name for logs, metadata and error messages."""
    if isinstance(env, str):
        return env
    if isinstance(env, gym.Env):
        return env.spec.id if env.spec is not None else type(env).__name__
    return getattr(env, "__name__", type(env).__name__)
