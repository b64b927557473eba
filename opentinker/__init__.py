"""OpenTinker: reinforcement learning as a service.

    from opentinker import RemoteEnv, PPOTrainer
    trainer = PPOTrainer(RemoteEnv("CartPole-v1"), policy="MLP")
    trainer.train(steps=200_000)
    service = trainer.deploy(api_key="...")

After ``opentinker.connect(url, api_key=...)`` the same code trains as a job on that OpenTinker server.

Names are resolved lazily so that ``import opentinker`` stays cheap and the CLI starts fast.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "BaseEnv": "opentinker.envs",
    "RemoteEnv": "opentinker.envs",
    "remote": "opentinker.envs",
    "validate_env": "opentinker.envs",
    "make_env": "opentinker.envs",
    "PPOTrainer": "opentinker.sdk",
    "DQNTrainer": "opentinker.sdk",
    "SACTrainer": "opentinker.sdk",
    "TD3Trainer": "opentinker.sdk",
    "GRPOTrainer": "opentinker.sdk",
    "PPOConfig": "opentinker.agents",
    "DQNConfig": "opentinker.agents",
    "SACConfig": "opentinker.agents",
    "TD3Config": "opentinker.agents",
    "get_settings": "opentinker.infra.settings",
    "connect": "opentinker.server.client",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'opentinker' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
