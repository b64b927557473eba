"""Atomic checkpoint files and capture/restore of every random number generator in play."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from opentinker.infra.files import atomic_write

CHECKPOINT_NAME = "checkpoint.pt"


def rng_state(trainer_rng: np.random.Generator) -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "numpy_global": np.random.get_state(),
        "python": random.getstate(),
        "trainer": trainer_rng.bit_generator.state,
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any], trainer_rng: np.random.Generator) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy_global"])
    random.setstate(state["python"])
    trainer_rng.bit_generator.state = state["trainer"]
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint file, or a directory holding ``checkpoint.pt``."""
    path = Path(path)
    return path / CHECKPOINT_NAME if path.is_dir() else path


def atomic_save(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """``torch.save`` through ``atomic_write``: a crash never leaves a torn checkpoint."""
    return atomic_write(path, lambda handle: torch.save(state, handle))


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint written by ``atomic_save`` (a trusted file: it holds pickled env state)."""
    path = resolve_checkpoint(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    return torch.load(path, map_location="cpu", weights_only=False)
