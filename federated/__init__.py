"""Federated training of RL policies through Flower (Message API): sites share weights, never data.

``from opentinker.federated import FLClient, FLServer`` (the seed API in ``api.py``) is resolved lazily, so the
Flower apps that import this package do not pay for it.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"FLClient": "opentinker.federated.api", "FLServer": "opentinker.federated.api"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'opentinker.federated' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
