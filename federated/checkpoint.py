"""Server checkpoint: the global model, the round it finished, the strategy's optimiser state and the history.

Written after every round as ``round-NNNN.npz`` (temp file + rename) and then ``latest.json`` pointing at it (also
temp + rename), so a crash at any moment leaves the previous complete checkpoint readable. Flower has no server
resume of its own (flwr issue #599); a restarted server loads ``latest.json`` and continues with the next round.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from opentinker.infra.files import atomic_write

Weights = dict[str, np.ndarray]


@dataclass
class ServerState:
    """Everything needed to continue a federated run after a server restart."""

    round: int
    """Last completed round (0: only the initial model was evaluated)."""
    weights: Weights
    """Global model after that round."""
    strategy_state: dict[str, Weights] = field(default_factory=dict)
    """Stateful strategies' tensors (FedAdam's moments m_t, v_t), keyed by name."""
    history: list[dict] = field(default_factory=list)
    """One dict of metrics per finished round (returns per site, bytes, seconds)."""
    mlflow_run_id: str = ""
    """The MLflow parent run, so a resumed server keeps logging into the same run."""


def save(directory: Path, state: ServerState) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {f"w/{k}": v for k, v in state.weights.items()}
    for group, tensors in state.strategy_state.items():
        arrays.update({f"s/{group}/{k}": v for k, v in tensors.items()})
    name = f"round-{state.round:04d}.npz"
    atomic_write(directory / name, lambda handle: np.savez(handle, **arrays))
    meta = {"round": state.round, "file": name, "history": state.history, "mlflow_run_id": state.mlflow_run_id}
    atomic_write(directory / "latest.json", json.dumps(meta, indent=1))
    for old in directory.glob("round-*.npz"):
        if old.name != name:
            old.unlink()
    return directory / name


def load(directory: Path) -> ServerState | None:
    """The last complete checkpoint in `directory`, or None when there is none."""
    latest = directory / "latest.json"
    if not latest.exists():
        return None
    meta = json.loads(latest.read_text())
    weights: Weights = {}
    strategy_state: dict[str, Weights] = {}
    with np.load(directory / meta["file"]) as data:
        for key in data.files:
            kind, rest = key.split("/", 1)
            if kind == "w":
                weights[rest] = data[key]
            else:
                group, name = rest.split("/", 1)
                strategy_state.setdefault(group, {})[name] = data[key]
    return ServerState(meta["round"], weights, strategy_state, meta["history"], meta.get("mlflow_run_id", ""))
