"""Generalised Advantage Estimation over a NEXT_STEP-autoreset rollout (see envs/rollout.py)."""

from __future__ import annotations

import numpy as np


def compute_gae(
    rewards: np.ndarray,
    values: np.ndarray,
    terminated: np.ndarray,
    truncated: np.ndarray,
    last_values: np.ndarray,
    gamma: float,
    gae_lambda: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Advantages and returns, arrays of shape (T, N).

    ``values[t + 1]`` (``last_values`` at the end) is the value of the observation that followed step ``t``;
    after an episode end that is the episode's final observation, so a truncated step bootstraps from it and
    a terminated one does not. The recursion stops at every episode end, so the reset steps that follow (not
    ``valid``, excluded from the loss) never leak into real ones.
    """
    next_values = np.concatenate([values[1:], last_values[None]], axis=0)
    not_terminal = 1.0 - terminated.astype(np.float32)
    continues = 1.0 - (terminated | truncated).astype(np.float32)
    deltas = rewards + gamma * next_values * not_terminal - values
    advantages = np.zeros_like(values, dtype=np.float32)
    running = np.zeros(values.shape[1], dtype=np.float32)
    for t in range(values.shape[0] - 1, -1, -1):
        running = deltas[t] + gamma * gae_lambda * continues[t] * running
        advantages[t] = running
    return advantages, advantages + values
