"""PPO trainer: collect a rollout with the numpy policy, compute GAE, run the clipped update (CleanRL order)."""
from __future__ import annotations

import time

import numpy as np
import torch

from opentinker.agents.advantages import compute_gae
from opentinker.agents.config import PPOConfig
from opentinker.agents.policies import ActorCritic, policy_spec
from opentinker.agents.trainer import Trainer


def explained_variance(predicted: np.ndarray, target: np.ndarray) -> float:
    var = np.var(target)
    return float("nan") if var == 0 else float(1 - np.var(target - predicted) / var)


class PPOTrainer(Trainer):
    """``PPOTrainer(env, policy="MLP", seed=0, device="auto", amp_mode="off", **PPOConfig fields)``."""

    algorithm, config_cls, value_based = "ppo", PPOConfig, False
    config: PPOConfig

    def _build(self) -> None:
        c = self.config
        self.spec = policy_spec(self.observation_space, self.action_space, False, c.hidden_sizes, c.activation)
        self.policy = ActorCritic(self.spec).to(self.device)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=c.learning_rate, eps=1e-5)

    def _iterate(self) -> dict[str, float]:
        c = self.config
        # 1. Learning-rate annealing over the run's horizon.
        if c.anneal_lr:
            frac = max(1.0 - self.global_step / self.horizon, 0.0)
            self.optimizer.param_groups[0]["lr"] = frac * c.learning_rate
        # 2. Rollout with a numpy copy of the current weights (in-process or on Ray workers).
        rollout = self.env.collect(self.policy.numpy_weights(), self.spec, c.n_steps, self.iteration)
        rollout_end = time.perf_counter()
        self.global_step += rollout.num_steps
        # 3. Advantages (GAE) and returns; reset steps after an episode end are dropped.
        advantages, returns = compute_gae(rollout.rewards, rollout.values, rollout.terminated, rollout.truncated,
                                          rollout.last_values, c.gamma, c.gae_lambda)
        keep = rollout.valid
        as_tensor = lambda a: torch.as_tensor(a[keep], device=self.device)  # noqa: E731
        b_obs, b_actions, b_logprobs = as_tensor(rollout.obs), as_tensor(rollout.actions), as_tensor(rollout.logprobs)
        b_advantages, b_returns, b_values = as_tensor(advantages), as_tensor(returns), as_tensor(rollout.values)
        b_x = self.policy.preprocess(b_obs)
        # 4. Clipped-objective update over shuffled minibatches.
        batch = b_x.shape[0]
        minibatch = max(batch // c.num_minibatches, 1)
        stats: dict[str, list[float]] = {k: [] for k in ("policy", "value", "entropy", "approx_kl", "clipfrac")}
        for _epoch in range(c.update_epochs):
            order = torch.as_tensor(self.rng.permutation(batch), device=self.device)
            for start in range(0, batch, minibatch):
                mb = order[start : start + minibatch]
                with self.amp.autocast():
                    newlogprob, entropy, newvalue = self.policy.evaluate_actions(b_x[mb], b_actions[mb])
                logratio = newlogprob - b_logprobs[mb]
                ratio = logratio.exp()
                with torch.no_grad():
                    approx_kl = ((ratio - 1) - logratio).mean()
                    stats["clipfrac"].append(((ratio - 1.0).abs() > c.clip_coef).float().mean().item())
                mb_adv = b_advantages[mb]
                if c.norm_adv and mb_adv.numel() > 1:
                    mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                pg_loss = torch.max(-mb_adv * ratio, -mb_adv * ratio.clamp(1 - c.clip_coef, 1 + c.clip_coef)).mean()
                if c.clip_vloss:
                    v_clipped = b_values[mb] + (newvalue - b_values[mb]).clamp(-c.clip_coef, c.clip_coef)
                    v_loss = 0.5 * torch.max((newvalue - b_returns[mb]) ** 2, (v_clipped - b_returns[mb]) ** 2).mean()
                else:
                    v_loss = 0.5 * ((newvalue - b_returns[mb]) ** 2).mean()
                entropy_loss = entropy.mean()
                loss = pg_loss - c.ent_coef * entropy_loss + v_loss * c.vf_coef
                self.amp.step(loss, self.optimizer, list(self.policy.parameters()), c.max_grad_norm)
                for key, value in (("policy", pg_loss), ("value", v_loss), ("entropy", entropy_loss), ("approx_kl", approx_kl)):
                    stats[key].append(value.item())
            if c.target_kl is not None and stats["approx_kl"][-1] > c.target_kl:
                break
        # 5. Metrics for the dashboard.
        metrics = {f"losses/{k}": float(np.mean(v)) for k, v in stats.items()}
        metrics["losses/explained_variance"] = explained_variance(rollout.values[keep], returns[keep])
        metrics["charts/learning_rate"] = self.optimizer.param_groups[0]["lr"]
        metrics["system/gradient_delay_ms"] = (time.perf_counter() - rollout_end) * 1000.0
        metrics.update(self.rollout_metrics(rollout))
        metrics.update(self.episode_metrics(rollout.episode_returns, rollout.episode_lengths))
        return metrics
