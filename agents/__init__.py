"""RL core: configs, policies, PPO, DQN, GRPO with the trainable LM policy, buffers, checkpoints, export.

Names resolve lazily so that importing one submodule (``agents.config``, ``agents.export``) never loads torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "PPOConfig": "opentinker.agents.config",
    "DQNConfig": "opentinker.agents.config",
    "PPO": "opentinker.agents.ppo",
    "DQN": "opentinker.agents.dqn",
    "EvalResult": "opentinker.agents.evaluation",
    "export_policy": "opentinker.agents.export",
    "load_policy": "opentinker.agents.export",
    "InferencePolicy": "opentinker.agents.export",
}
__all__ = sorted(_EXPORTS)
_TRAINERS = {"ppo": "PPO", "dqn": "DQN"}


def trainer_class(algorithm: str) -> type:
    """The RL-core trainer for an algorithm name (a key of ``config.CONFIGS``)."""
    if algorithm not in _TRAINERS:
        raise ValueError(f"algorithm must be one of {sorted(_TRAINERS)}, got {algorithm!r}")
    return __getattr__(_TRAINERS[algorithm])


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'opentinker.agents' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
