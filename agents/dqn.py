"""DQN trainer: epsilon-greedy rollouts with the numpy Q network (``collect``), then ``update(rollout)``: replay,
TD updates, target network."""

from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F

from opentinker.agents.config import DQNConfig
from opentinker.agents.policies import QNetwork, policy_spec
from opentinker.agents.replay import ReplayTrainer
from opentinker.envs.observations import index_obs
from opentinker.envs.rollout import Rollout


def linear_schedule(start: float, end: float, duration: float, step: int) -> float:
    return max(end, start + (end - start) * step / max(duration, 1.0))


class DQN(ReplayTrainer):
    """``DQN(env, policy="MLP", seed=0, device="auto", amp_mode="off", **DQNConfig fields)``."""

    algorithm, config_cls, value_based = "dqn", DQNConfig, True
    config: DQNConfig

    def _build(self) -> None:
        c = self.config
        self.spec = policy_spec(self.observation_space, self.action_space, True, c.hidden_sizes, c.activation)
        self.policy = QNetwork(self.spec).to(self.device)
        self.target = copy.deepcopy(self.policy)
        self.params = list(self.policy.parameters())
        self.optimizer = torch.optim.Adam(self.params, lr=c.learning_rate, fused=True)
        self._build_replay()
        self.next_target_update = c.target_network_frequency

    def epsilon(self) -> float:
        """Exploration rate of the next rollout: the multiplicative (``epsilon_decay``) or linear schedule."""
        c = self.config
        if c.epsilon_decay is not None:
            return max(c.end_e, c.start_e * c.epsilon_decay ** (self.global_step // c.num_envs))
        if self.horizon is None:
            raise RuntimeError("DQN epsilon schedule has no horizon yet: set total_steps or call train(steps) first")
        return linear_schedule(c.start_e, c.end_e, c.exploration_fraction * self.horizon, self.global_step)

    def rollout_spec(self) -> dict:
        return dict(self.spec, epsilon=self.epsilon())

    def update(self, rollout: Rollout) -> dict[str, float]:
        c = self.config
        rollout_end = time.perf_counter()
        # 1. The rollout was collected epsilon-greedily with the current Q network; count and keep its transitions.
        epsilon = self.epsilon()
        self.store(rollout)
        # 2. One TD update per ``train_frequency`` env steps once learning has started, on batches drawn together.
        losses, q_values = [], []
        batches = self.replay_batches(rollout.num_steps)
        for i in range(0 if batches is None else len(batches["rewards"])):
            batch = {k: index_obs(v, i) for k, v in batches.items()}
            with torch.no_grad():
                target_max = self.target(self.target.preprocess(batch["next_obs"])).float().max(dim=1).values
                td_target = batch["rewards"] + c.gamma * target_max * (1.0 - batch["terminated"])
            with self.amp.autocast():
                q_all = self.policy(self.policy.preprocess(batch["obs"]))
            q_taken = q_all.float().gather(1, batch["actions"].long().unsqueeze(1)).squeeze(1)
            loss = F.smooth_l1_loss(q_taken, td_target)  # Huber: the Nature DQN's clipped error, as SB3
            self.amp.step(loss, self.optimizer, self.params, c.max_grad_norm, reduce=self.sync.reduce)
            losses.append(loss.detach())
            q_values.append(q_taken.detach().mean())
        # 3. Target network: soft/hard update every ``target_network_frequency`` env steps.
        while self.global_step >= self.next_target_update:
            self.next_target_update += c.target_network_frequency
            self.update_target()
        metrics = {
            "charts/epsilon": epsilon,
            "charts/buffer_size": float(len(self.buffer)),
            "perf/update_ms": (time.perf_counter() - rollout_end) * 1000.0,
        }
        if losses:  # one host sync per iteration; with several learners, the whole minibatches' statistics
            td_loss, q_mean = self.sync.average(torch.stack([torch.stack(losses).mean(), torch.stack(q_values).mean()]))
            metrics["losses/td_loss"], metrics["losses/q_values"] = td_loss.item(), q_mean.item()
        metrics.update(self.rollout_metrics(rollout, updated=bool(losses)))
        metrics.update(self.episode_metrics(rollout.episode_returns, rollout.episode_lengths))
        return metrics

    def update_target(self) -> None:
        """target <- tau * online + (1 - tau) * target."""
        with torch.no_grad():
            for target_param, param in zip(self.target.parameters(), self.policy.parameters()):
                target_param.lerp_(param, self.config.tau)

    def _extra_state(self) -> dict:
        extra = {"target": self.target.state_dict(), "next_target_update": self.next_target_update}
        return {**super()._extra_state(), **extra}

    def _load_extra_state(self, state: dict) -> None:
        super()._load_extra_state(state)
        self.target.load_state_dict(state["target"])
        self.next_target_update = state["next_target_update"]
