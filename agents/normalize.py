"""Running statistics for observation and reward normalisation, after SB3's ``VecNormalize``.

Observation statistics live in the policy as buffers (``obs_mean``/``obs_var``), so they travel with the weights
into rollout workers, checkpoints, exports and serving; the trainer updates them after each rollout. Reward
normalisation divides each reward by the running std of the discounted return and only matters to the learner.
"""

from __future__ import annotations

import numpy as np

EPS = 1e-8


def update_moments(mean: np.ndarray, var: np.ndarray, count: float, batch: np.ndarray):
    """Chan et al.'s parallel update of (mean, var, count) with a batch (rows are samples)."""
    b_mean, b_var, b_count = batch.mean(axis=0), batch.var(axis=0), batch.shape[0]
    delta, total = b_mean - mean, count + b_count
    new_mean = mean + delta * b_count / total
    m2 = var * count + b_var * b_count + delta**2 * count * b_count / total
    return new_mean, m2 / total, total


class ReturnNormalizer:
    """Scales rewards by the running std of each env copy's discounted return (``VecNormalize(norm_reward=True)``)."""

    def __init__(self, num_envs: int, gamma: float, clip: float):
        self.gamma, self.clip = gamma, clip
        self.returns = np.zeros(num_envs, np.float64)
        self.var, self.count = np.ones((), np.float64), EPS
        self.mean = np.zeros((), np.float64)

    def __call__(self, rewards: np.ndarray, dones: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """``rewards``/``dones``/``valid`` are (n_steps, num_envs); invalid (reset) steps leave the returns alone."""
        for t in range(rewards.shape[0]):
            self.returns = np.where(valid[t], self.returns * self.gamma + rewards[t], self.returns)
            if valid[t].any():
                self.mean, self.var, self.count = update_moments(
                    self.mean, self.var, self.count, self.returns[valid[t]]
                )
            self.returns[dones[t]] = 0.0
        scaled = rewards / np.sqrt(self.var + EPS)
        return np.clip(scaled, -self.clip, self.clip).astype(np.float32)

    def state_dict(self) -> dict:
        return {"returns": self.returns.copy(), "mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.returns, self.mean, self.var = (np.array(state[k]) for k in ("returns", "mean", "var"))
        self.count = float(state["count"])
