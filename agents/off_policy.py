"""What SAC and TD3 share: env copies act with the actor's numpy twin (uniform random actions until
``learning_starts``), the twin critics and their Polyak-averaged target, replay (``agents/replay.py``). The
algorithms' own ``update`` and ``gradient_step`` live in ``sac.py`` and ``td3.py``.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from opentinker.agents.config import OffPolicyConfig
from opentinker.agents.critics import TwinQ
from opentinker.agents.policies import policy_spec
from opentinker.agents.replay import ReplayTrainer
from opentinker.envs.rollout import Rollout


class OffPolicyTrainer(ReplayTrainer):
    """Subclasses set ``actor_kind`` and ``actor_cls``, build their extras in ``_build_extras`` and implement
    ``update``. The actor is ``self.policy`` (what rollouts, checkpoints' ``policy`` and exports hold)."""

    value_based = False
    default_amp_mode = "auto"  # a gradient step is ~16 matmuls of 256x256 at batch 256: bf16 where it is native
    actor_kind: str
    actor_cls: type
    config: OffPolicyConfig

    def _build(self) -> None:
        c = self.config
        self.spec = policy_spec(
            self.observation_space, self.action_space, False, c.hidden_sizes, c.activation, actor=self.actor_kind
        )
        self.policy = self.actor_cls(self.spec).to(self.device)
        self.params = list(self.policy.parameters())
        self.optimizer = torch.optim.Adam(self.params, lr=c.learning_rate, fused=True)
        # Twin critics as one module: one optimiser step for both; the target is its Polyak average.
        self.critic = TwinQ(self.spec).to(self.device)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.critic_params, self.target_params = list(self.critic.parameters()), list(self.critic_target.parameters())
        self.critic_optimizer = torch.optim.Adam(self.critic_params, lr=c.learning_rate, fused=True)
        self._build_replay()
        # The learner's own noise source (not torch's global one): trainers sharing a process stay independent.
        self.noise_rng = torch.Generator(self.device).manual_seed(self.seed)
        self._build_extras()

    def _build_extras(self) -> None:
        pass

    def rollout_spec(self) -> dict:
        """Uniform random actions until ``learning_starts`` (as SB3 and CleanRL warm up), then the actor's."""
        return dict(self.spec, uniform_actions=True) if self.warming_up else self.spec

    def standard_normal(self, *shape: int) -> torch.Tensor:
        """Noise for whole batches from the trainer's generator (in every checkpoint); learners take their rows
        (``shard``), so each row's noise is the same with any number of learners."""
        size = (*shape, self.config.batch_size, self.spec["action_dim"])
        noise = torch.randn(size, generator=self.noise_rng, device=self.device)
        return noise[..., self.sync.shard(self.config.batch_size), :]

    def finish_update(self, rollout: Rollout, started: float, stats: list[torch.Tensor], names: tuple[str, ...]):
        """The iteration's metrics: the gradient steps' statistics (one host sync, averaged over learners), the
        buffer, timings, rollout and episode figures."""
        metrics = {"charts/buffer_size": float(len(self.buffer))}
        if stats:
            means = self.sync.average(torch.stack(stats).mean(0))
            metrics.update(zip(names, means.tolist()))
        metrics["perf/update_ms"] = (time.perf_counter() - started) * 1000.0
        metrics.update(self.rollout_metrics(rollout, updated=bool(stats)))
        metrics.update(self.episode_metrics(rollout.episode_returns, rollout.episode_lengths))
        return metrics

    def _extra_state(self) -> dict[str, Any]:
        return {
            **super()._extra_state(),
            "critic": self.critic.state_dict(),
            "critic_target": self.critic_target.state_dict(),
            "critic_optimizer": self.critic_optimizer.state_dict(),
            "noise_rng": (self.noise_rng.device.type, self.noise_rng.get_state()),
        }

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        super()._load_extra_state(state)
        self.critic.load_state_dict(state["critic"])
        self.critic_target.load_state_dict(state["critic_target"])
        self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        device_type, rng_state = state["noise_rng"]
        if device_type == self.noise_rng.device.type:  # CPU and CUDA generators differ: a moved run keeps its seed
            self.noise_rng.set_state(rng_state)
