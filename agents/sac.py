"""SAC trainer: ``collect()`` with the actor's numpy twin, then ``update(rollout)``: replay, then per gradient step
the soft Q update of both critics, the policy update, the temperature update and target smoothing (Haarnoja et al.
2018, "Soft Actor-Critic Algorithms and Applications", Algorithm 1; equation numbers from that paper)."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from opentinker.agents.actors import SquashedGaussianActor
from opentinker.agents.config import SACConfig
from opentinker.agents.off_policy import OffPolicyTrainer
from opentinker.envs.observations import index_obs
from opentinker.envs.rollout import Rollout

STATS = ("losses/critic", "losses/actor", "charts/alpha", "losses/q_values", "losses/entropy", "losses/alpha")


class SAC(OffPolicyTrainer):
    """``SAC(env, policy="MLP", seed=0, device="auto", amp_mode="auto", **SACConfig fields)``."""

    algorithm, config_cls = "sac", SACConfig
    actor_kind, actor_cls = "squashed_gaussian", SquashedGaussianActor
    config: SACConfig

    def _build_extras(self) -> None:
        c = self.config
        self.target_entropy = -float(self.spec["action_dim"]) if c.target_entropy is None else c.target_entropy
        initial = 0.0 if c.alpha is None else math.log(c.alpha)  # a learned alpha starts at 1 (SB3, CleanRL)
        self.log_alpha = torch.full((), initial, device=self.device, requires_grad=c.alpha is None)
        self.alpha_optimizer = torch.optim.Adam([self.log_alpha], lr=c.learning_rate, fused=True)

    def update(self, rollout: Rollout) -> dict[str, float]:
        started = time.perf_counter()
        # 1. Keep the rollout's transitions (collected with the current actor, or uniformly while warming up).
        self.store(rollout)
        # 2. The gradient steps due, on batches drawn together; noise for both actor samples of every step.
        stats = []
        batch = self.replay_batches(rollout.num_steps)
        if batch is not None:
            noise = self.standard_normal(len(batch["rewards"]), 2)
            for i in range(len(batch["rewards"])):
                step = {k: index_obs(v, i) for k, v in batch.items()}
                stats.append(self.gradient_step(**step, noise=noise[i]))
        return self.finish_update(rollout, started, stats, STATS)

    def gradient_step(
        self,
        obs: Any,
        next_obs: Any,
        actions: torch.Tensor,
        rewards: torch.Tensor,
        terminated: torch.Tensor,
        noise: torch.Tensor,
    ) -> torch.Tensor:
        """One step of Algorithm 1 on a batch; its statistics as one tensor (no host sync)."""
        c = self.config
        obs, next_obs = self.policy.preprocess(obs), self.policy.preprocess(next_obs)
        alpha = self.log_alpha.detach().exp()
        # Soft Q target (eq. 2-3): r + gamma (1 - d) (min_j Qtarget_j(s', a') - alpha log pi(a'|s')), a' ~ pi(.|s').
        with torch.no_grad(), self.amp.autocast():
            next_actions, next_logp = self.policy.sample_with_log_prob(next_obs, noise[1])
            next_q = self.critic_target(next_obs, next_actions).float().min(0).values - alpha * next_logp
            target = rewards + c.gamma * (1.0 - terminated) * next_q
        # Both critics regress on it (eq. 5): J_Q = E[0.5 (Q_j(s, a) - target)^2], summed over j.
        with self.amp.autocast():
            q = self.critic(obs, actions).float()
        critic_loss = 0.5 * (q - target).square().mean(1).sum()
        self.amp.step(critic_loss, self.critic_optimizer, self.critic_params, None, reduce=self.sync.reduce)
        # Policy (eq. 7, reparameterised): J_pi = E[alpha log pi(a|s) - min_j Q_j(s, a)], a = tanh(mean + std * noise).
        with self.amp.autocast():
            pi, logp = self.policy.sample_with_log_prob(obs, noise[0])
            q_pi = self.critic(obs, pi, frozen=True).float().min(0).values
        actor_loss = (alpha * logp - q_pi).mean()
        self.amp.step(actor_loss, self.optimizer, self.params, None, reduce=self.sync.reduce)
        # Temperature (eq. 18): J(alpha) = E[-alpha (log pi(a|s) + target entropy)], on log alpha.
        logp = logp.detach()
        alpha_loss = -(self.log_alpha * (logp + self.target_entropy)).mean()
        if self.config.alpha is None:
            self.amp.step(alpha_loss, self.alpha_optimizer, [self.log_alpha], None, reduce=self.sync.reduce)
        # Target critics: Polyak averaging, target <- tau * critic + (1 - tau) * target.
        torch._foreach_lerp_(self.target_params, self.critic_params, c.tau)
        return torch.stack(
            [critic_loss.detach(), actor_loss.detach(), alpha, q.detach().mean(), -logp.mean(), alpha_loss.detach()]
        )

    def _extra_state(self) -> dict:
        return {
            **super()._extra_state(),
            "log_alpha": self.log_alpha.detach().clone(),
            "alpha_optimizer": self.alpha_optimizer.state_dict(),
        }

    def _load_extra_state(self, state: dict) -> None:
        super()._load_extra_state(state)
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        self.alpha_optimizer.load_state_dict(state["alpha_optimizer"])
