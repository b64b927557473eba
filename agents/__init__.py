"""RL core: configs, policies, PPO, DQN, SAC, TD3, GRPO with the trainable LM policy, buffers, checkpoints, export.

Names resolve lazily so that importing one submodule (``agents.config``, ``agents.export``) never loads torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "PPOConfig": "opentinker.agents.config",
    "DQNConfig": "opentinker.agents.config",
    "SACConfig": "opentinker.agents.config",
    "TD3Config": "opentinker.agents.config",
    "PPO": "opentinker.agents.ppo",
    "DQN": "opentinker.agents.dqn",
    "SAC": "opentinker.agents.sac",
    "TD3": "opentinker.agents.td3",
    "EvalResult": "opentinker.agents.evaluation",
    "export_policy": "opentinker.agents.export",
    "load_policy": "opentinker.agents.export",
    "InferencePolicy": "opentinker.agents.export",
}
__all__ = sorted(_EXPORTS)
_TRAINERS = {"ppo": "PPO", "dqn": "DQN", "sac": "SAC", "td3": "TD3"}


def trainer_class(algorithm: str) -> type:
    """The RL-core trainer for an algorithm name (a key of ``config.CONFIGS``)."""
    if algorithm not in _TRAINERS:
        raise ValueError(f"algorithm must be one of {sorted(_TRAINERS)}, got {algorithm!r}")
    return __getattr__(_TRAINERS[algorithm])


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'opentinker.agents' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
