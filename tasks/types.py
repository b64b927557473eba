"""Small typed values passed between tasks: ids, URIs, numbers — never tensors.

Evaluations are the RL core's ``EvalResult``; model references are ``tracking.registry.ModelRef``."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ProbeSummary(BaseModel):
    """What the probe rollout measured on the Ray workers."""

    steps: int
    episodes: int
    mean_return: float | None
    seconds: float


class TrainOutcome(BaseModel):
    """The training stage's result: where the weights are, how far it got."""

    run_id: str
    checkpoint_path: str = Field(description="Latest full checkpoint (weights, optimiser, RNG states).")
    export_dir: str = Field(description="Numpy-only export (policy.json + weights.npz) for evaluation and serving.")
    history_path: str = Field(description="Per-iteration metrics, JSON lines, for the plots.")
    start_step: int = Field(description="Global env step training started from (> 0 when resumed).")
    global_step: int
    iterations: int
    train_seconds: float
    worker_pids: list[int] = []
