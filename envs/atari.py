"""Atari ids (``ALE/Breakout-v5``, ...): registered with gymnasium on first use and preprocessed by default.

ale-py registers its ids when imported; that import happens here, in ``register_ale``, the first time an ``ALE/`` id
is built, never as a side effect of importing ``opentinker``. ``make_atari`` then applies gymnasium's
``AtariPreprocessing`` (no-op starts up to 30, 4 frames per action max-pooled over the last two, 84x84 grayscale
uint8; the ALE env is made with ``frameskip=1`` so frames are not skipped twice) and stacks the last 4 frames
(``FrameStackObservation``): observations are ``(4, 84, 84)`` uint8. v5's sticky actions (repeat probability 0.25)
stay, and rewards are the game's (no clipping: the returns the gate compares are scores). ``preprocess=False`` gives
the raw env, ``frame_stack=1`` no stacking; a factory (``module:make_my_env``) builds anything else.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

ATARI_NAMESPACE = "ALE"
FRAME_STACK = 4


def is_atari(env: Any) -> bool:
    """Whether ``env`` is an id in the ALE namespace."""
    return isinstance(env, str) and env.startswith(f"{ATARI_NAMESPACE}/")


def register_ale() -> None:
    """Register ale-py's ids with gymnasium (its import does it; ``register_envs`` names that intent)."""
    import ale_py

    gym.register_envs(ale_py)


def make_atari(env_id: str, preprocess: bool = True, frame_stack: int = FRAME_STACK, **kwargs: Any) -> gym.Env:
    """One Atari env: preprocessed and frame-stacked by default (see the module docstring); ``kwargs`` go to
    ``gymnasium.make`` (e.g. ``repeat_action_probability``, ``full_action_space``)."""
    register_ale()
    if not preprocess:
        return gym.make(env_id, **kwargs)
    env = gym.wrappers.AtariPreprocessing(
        gym.make(env_id, frameskip=1, **kwargs),
        noop_max=30,
        frame_skip=4,
        screen_size=84,
        terminal_on_life_loss=False,
        grayscale_obs=True,
        scale_obs=False,
    )
    return gym.wrappers.FrameStackObservation(env, frame_stack) if frame_stack > 1 else env
