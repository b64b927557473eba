"""The article's dashboard targets and, for a run whose figures miss them, its remedies (set as the training run's
MLflow tag ``opentinker.dashboard_remedies``)."""

from __future__ import annotations

import numpy as np

ROLLOUT_EFFICIENCY_TARGET = 0.85
GRADIENT_DELAY_TARGET_MS = 50.0


def dashboard_remedies(history: list[dict[str, float]]) -> list[str]:
    """The article's remedy for each dashboard figure that misses its target over ``history`` (one metrics dict per
    iteration; medians, so one slow iteration does not count); empty when all targets hold."""
    remedies = []
    metrics = {
        key: float(np.median([row[key] for row in history if key in row]))
        for key in ("perf/rollout_efficiency", "perf/rollout_worker_share", "perf/gradient_delay_ms")
        if any(key in row for row in history)
    }
    efficiency = metrics.get("perf/rollout_efficiency")
    if efficiency is not None and efficiency < ROLLOUT_EFFICIENCY_TARGET:
        if metrics.get("perf/rollout_worker_share", 1.0) < ROLLOUT_EFFICIENCY_TARGET:
            where = (
                "most of the rest is outside the workers (dispatch, transfer, scheduling): raise parallel so each "
                "call carries more transitions, or step cheap envs in-process (backend='local', which "
                "backend='auto' picks for them)"
            )
        else:
            where = (
                "the rest is the workers' own per-step bookkeeping (and state_diff encoding): raise parallel so "
                "each vectorised step carries more transitions"
            )
        remedies.append(f"rollout efficiency {efficiency:.0%} < {ROLLOUT_EFFICIENCY_TARGET:.0%}; {where}")
    delay = metrics.get("perf/gradient_delay_ms")
    if delay is not None and delay > GRADIENT_DELAY_TARGET_MS:
        remedies.append(
            f"gradient delay {delay:.0f} ms > {GRADIENT_DELAY_TARGET_MS:.0f} ms: check the network latency "
            "between the learner and the rollout workers (and time spent in per-iteration callbacks)"
        )
    return remedies
