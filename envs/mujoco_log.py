"""MuJoCo's warnings to Python logging instead of a ``MUJOCO_LOG.TXT`` file in the working directory.

MuJoCo 4 warns, at every build of gymnasium's v5 models (HalfCheetah, Hopper, ...), that their XML uses the deprecated
``settotalmass`` compiler attribute; its default handler prints that and appends it to ``MUJOCO_LOG.TXT`` wherever the
process runs (a repository, a flow's work dir). The handler is set here, the first time ``make_env`` builds one of
gymnasium's MuJoCo ids (never at import), unless the program set its own.
"""

from __future__ import annotations

import logging

import gymnasium as gym

log = logging.getLogger("opentinker.envs")


def route_mujoco_warnings(spec: gym.envs.registration.EnvSpec) -> None:
    """For a gymnasium MuJoCo env's spec: send MuJoCo's warnings to the ``opentinker.envs`` logger (debug level)."""
    entry_point = spec.entry_point
    if not (isinstance(entry_point, str) and entry_point.startswith("gymnasium.envs.mujoco")):
        return
    import mujoco

    if mujoco.get_mju_user_warning() is None:
        mujoco.set_mju_user_warning(lambda message: log.debug("MuJoCo warning: %s", message))
