"""PPO trainer: ``collect()`` a rollout with the numpy policy (the base trainer), then ``update(rollout)``:
GAE and the clipped update (CleanRL order)."""

from __future__ import annotations

import time

import numpy as np
import torch

from opentinker.agents.advantages import compute_gae
from opentinker.agents.config import PPOConfig
from opentinker.agents.normalize import ReturnNormalizer
from opentinker.agents.policies import ActorCritic, policy_spec
from opentinker.agents.trainer import Trainer
from opentinker.envs.observations import index_obs, map_obs
from opentinker.envs.rollout import Rollout


def clipped_policy_loss(advantages: torch.Tensor, ratio: torch.Tensor, clip_coef: float) -> torch.Tensor:
    """PPO's pessimistic surrogate: mean of max(-A * r, -A * clip(r, 1 - eps, 1 + eps))."""
    return torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip_coef, 1 + clip_coef)).mean()


def value_loss(
    new_values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip_coef: float | None
) -> torch.Tensor:
    """0.5 * squared error; with ``clip_coef`` the pessimistic max over the clipped and unclipped update."""
    unclipped = (new_values - returns) ** 2
    if clip_coef is None:
        return 0.5 * unclipped.mean()
    clipped = (old_values + (new_values - old_values).clamp(-clip_coef, clip_coef) - returns) ** 2
    return 0.5 * torch.max(unclipped, clipped).mean()


def normalize(advantages: torch.Tensor) -> torch.Tensor:
    return (advantages - advantages.mean()) / (advantages.std() + 1e-8) if advantages.numel() > 1 else advantages


def explained_variance(predicted: np.ndarray, target: np.ndarray) -> float:
    var = np.var(target)
    return float("nan") if var == 0 else float(1 - np.var(target - predicted) / var)


class PPO(Trainer):
    """``PPO(env, policy="MLP", seed=0, device="auto", amp_mode="off", **PPOConfig fields)``."""

    algorithm, config_cls, value_based = "ppo", PPOConfig, False
    config: PPOConfig

    def _build(self) -> None:
        c = self.config
        self.spec = policy_spec(
            self.observation_space,
            self.action_space,
            False,
            c.hidden_sizes,
            c.activation,
            c.norm_clip if c.norm_obs else None,
        )
        self.policy = ActorCritic(self.spec).to(self.device)
        self.reward_norm = ReturnNormalizer(c.num_envs, c.gamma, c.norm_clip) if c.norm_reward else None
        self.params = list(self.policy.parameters())
        # fused Adam: one kernel per step instead of a dozen per tensor (small MLPs are overhead-bound).
        self.optimizer = torch.optim.Adam(self.params, lr=c.learning_rate, eps=1e-5, fused=True)

    def update(self, rollout: Rollout) -> dict[str, float]:
        c = self.config
        rollout_end = time.perf_counter()
        # 1. Learning-rate annealing over the run's horizon (progress before this rollout).
        if c.anneal_lr:
            frac = max(1.0 - self.global_step / self.horizon, 0.0)
            self.optimizer.param_groups[0]["lr"] = frac * c.learning_rate
        # 2. The rollout was collected with a numpy copy of the current weights; count its env steps.
        self.global_step += rollout.num_steps
        # 3. Advantages (GAE) and returns; reset steps after an episode end are dropped.
        rewards = rollout.rewards
        if self.reward_norm is not None:
            rewards = self.reward_norm(rewards, rollout.terminated | rollout.truncated, rollout.valid)
        advantages, returns = compute_gae(
            rewards * c.reward_scale,
            rollout.values,
            rollout.terminated,
            rollout.truncated,
            rollout.last_values,
            c.gamma,
            c.gae_lambda,
        )
        keep = rollout.valid
        as_tensor = lambda a: torch.as_tensor(a[keep], device=self.device)  # noqa: E731
        b_obs, b_actions, b_logprobs = (
            map_obs(as_tensor, rollout.obs),
            as_tensor(rollout.actions),
            as_tensor(rollout.logprobs),
        )
        b_advantages, b_returns, b_values = as_tensor(advantages), as_tensor(returns), as_tensor(rollout.values)
        b_x = self.policy.preprocess(b_obs)  # images stay uint8 here; the CNN runs per minibatch
        # 4. Clipped-objective update over shuffled minibatches.
        batch = len(b_actions)
        minibatch = -(-batch // c.num_minibatches)  # ceil: exactly num_minibatches per epoch
        stats: dict[str, list[torch.Tensor]] = {k: [] for k in ("policy", "value", "entropy", "approx_kl", "clipfrac")}
        for _epoch in range(c.update_epochs):
            order = torch.as_tensor(self.rng.permutation(batch), device=self.device)
            for start in range(0, batch, minibatch):
                mb = order[start : start + minibatch]
                mb_adv = normalize(b_advantages[mb]) if c.norm_adv else b_advantages[mb]
                part = self.sync.shard(len(mb))  # this learner's rows (all of them when it is alone)
                mb, mb_adv = mb[part], mb_adv[part]
                with self.amp.autocast():
                    newlogprob, entropy, newvalue = self.policy.evaluate_actions(index_obs(b_x, mb), b_actions[mb])
                logratio = newlogprob - b_logprobs[mb]
                ratio = logratio.exp()
                with torch.no_grad():
                    approx_kl = ((ratio - 1) - logratio).mean()
                    stats["clipfrac"].append(((ratio - 1.0).abs() > c.clip_coef).float().mean())
                pg_loss = clipped_policy_loss(mb_adv, ratio, c.clip_coef)
                v_loss = value_loss(newvalue, b_values[mb], b_returns[mb], c.clip_coef if c.clip_vloss else None)
                entropy_loss = entropy.mean()
                loss = pg_loss - c.ent_coef * entropy_loss + v_loss * c.vf_coef
                self.amp.step(loss, self.optimizer, self.params, c.max_grad_norm, reduce=self.sync.reduce)
                # The whole minibatch's statistics (every learner needs the same approx_kl for target_kl).
                step_stats = [pg_loss, v_loss, entropy_loss, approx_kl, stats["clipfrac"].pop()]
                step_stats = self.sync.average(torch.stack([v.detach().float() for v in step_stats]))
                for key, value in zip(("policy", "value", "entropy", "approx_kl", "clipfrac"), step_stats):
                    stats[key].append(value)
            if c.target_kl is not None and stats["approx_kl"][-1].item() > c.target_kl:
                break
        # 5. Observation statistics for the next rollout (this one was collected and trained with the old ones).
        self.policy.update_obs_norm(index_obs(rollout.obs, keep))
        # 6. Metrics for the dashboard.
        metrics = {f"losses/{k}": torch.stack(v).mean().item() for k, v in stats.items()}
        metrics["losses/explained_variance"] = explained_variance(rollout.values[keep], returns[keep])
        metrics["charts/learning_rate"] = self.optimizer.param_groups[0]["lr"]
        metrics["perf/update_ms"] = (time.perf_counter() - rollout_end) * 1000.0
        metrics.update(self.rollout_metrics(rollout))
        metrics.update(self.episode_metrics(rollout.episode_returns, rollout.episode_lengths))
        return metrics

    def _extra_state(self) -> dict:
        return {} if self.reward_norm is None else {"reward_norm": self.reward_norm.state_dict()}

    def _load_extra_state(self, state: dict) -> None:
        if self.reward_norm is not None:
            self.reward_norm.load_state_dict(state["reward_norm"])
