"""TD3 trainer: ``collect()`` with the actor's numpy twin plus Gaussian exploration noise, then ``update(rollout)``:
replay, then per gradient step the clipped double-Q update with target policy smoothing, and every ``policy_delay``
steps the deterministic policy gradient step and the target updates (Fujimoto et al. 2018, Algorithm 1)."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from opentinker.agents.actors import DeterministicActor
from opentinker.agents.config import TD3Config
from opentinker.agents.off_policy import OffPolicyTrainer
from opentinker.envs.observations import index_obs
from opentinker.envs.rollout import Rollout

STATS = ("losses/critic", "losses/actor", "losses/q_values")


class TD3(OffPolicyTrainer):
    """``TD3(env, policy="MLP", seed=0, device="auto", amp_mode="auto", **TD3Config fields)``."""

    algorithm, config_cls = "td3", TD3Config
    actor_kind, actor_cls = "deterministic", DeterministicActor
    config: TD3Config

    def _build_extras(self) -> None:
        self.actor_target = copy.deepcopy(self.policy).requires_grad_(False)
        self.actor_target_params = list(self.actor_target.parameters())
        self.critic_updates = 0
        self.last_actor_loss = torch.zeros((), device=self.device)

    def rollout_spec(self) -> dict:
        """The actor's actions plus N(0, ``exploration_noise``) noise (uniform while warming up)."""
        return dict(super().rollout_spec(), action_noise=self.config.exploration_noise)

    def update(self, rollout: Rollout) -> dict[str, float]:
        started = time.perf_counter()
        # 1. Keep the rollout's transitions (collected with the noisy actor, or uniformly while warming up).
        self.store(rollout)
        # 2. The gradient steps due, on batches drawn together, with their target policy smoothing noise.
        stats = []
        batch = self.replay_batches(rollout.num_steps)
        if batch is not None:
            noise = self.standard_normal(len(batch["rewards"]))
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
        # Target policy smoothing: a' = clip(mu_target(s') + clip(noise, -c, c), -1, 1); clipped double-Q target.
        with torch.no_grad(), self.amp.autocast():
            smoothing = (noise * c.policy_noise).clamp(-c.noise_clip, c.noise_clip)
            next_actions = (self.actor_target(next_obs) + smoothing).clamp(-1.0, 1.0)
            next_q = self.critic_target(next_obs, next_actions).float().min(0).values
            target = rewards + c.gamma * (1.0 - terminated) * next_q
        # Both critics regress on it: sum over j of E[(Q_j(s, a) - target)^2].
        with self.amp.autocast():
            q = self.critic(obs, actions).float()
        critic_loss = (q - target).square().mean(1).sum()
        self.amp.step(critic_loss, self.critic_optimizer, self.critic_params, None, reduce=self.sync.reduce)
        self.critic_updates += 1
        # Delayed policy update: every policy_delay critic steps, the deterministic policy gradient through Q_1,
        # then both targets move: target <- tau * online + (1 - tau) * target.
        if self.critic_updates % c.policy_delay == 0:
            with self.amp.autocast():
                actor_loss = -self.critic(obs, self.policy(obs), frozen=True)[0].float().mean()
            self.amp.step(actor_loss, self.optimizer, self.params, None, reduce=self.sync.reduce)
            self.last_actor_loss = actor_loss.detach()
            torch._foreach_lerp_(self.actor_target_params, self.params, c.tau)
            torch._foreach_lerp_(self.target_params, self.critic_params, c.tau)
        return torch.stack([critic_loss.detach(), self.last_actor_loss, q.detach().mean()])

    def _extra_state(self) -> dict:
        return {
            **super()._extra_state(),
            "actor_target": self.actor_target.state_dict(),
            "critic_updates": self.critic_updates,
            "last_actor_loss": self.last_actor_loss,
        }

    def _load_extra_state(self, state: dict) -> None:
        super()._load_extra_state(state)
        self.actor_target.load_state_dict(state["actor_target"])
        self.critic_updates = state["critic_updates"]
        self.last_actor_loss = state["last_actor_loss"].to(self.device)
