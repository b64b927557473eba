"""The GRPO trainer: the learner (a ``MultiLoraModel`` with the policy's adapter, AdamW, in this process), the
rollout workers (Ray actors or in-process, sampling with the Tinker engine's sampler), a step that samples groups,
scores them and applies ``agents/grpo.py``'s loss, checkpoints with a bit-exact resume, and greedy evaluation on
fixed prompts."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from opentinker.agents.checkpoint import (
    atomic_save,
    load_checkpoint,
    restore_rng_state,
    rng_state,
)
from opentinker.agents.grpo import GRPOConfig, completion_logprobs, group_advantages, reduce_loss, token_loss
from opentinker.agents.lm_rollout import POLICY
from opentinker.agents.trainer import check_train_args, train_loop


class PromptSampler:
    """Train prompt indices without replacement, epoch after epoch, each epoch a seeded permutation.

    Its whole state is (epoch, position): saved in checkpoints, so a resumed run draws the same prompts."""

    def __init__(self, n: int, seed: int, epoch: int = 0, position: int = 0):
        self.n, self.seed, self.epoch, self.position = n, seed, epoch, position

    def _order(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.n)

    def draw(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            order = self._order()
            take = order[self.position : self.position + k - len(out)].tolist()
            out += take
            self.position += len(take)
            if self.position >= self.n:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}


@dataclass(frozen=True)
class LLMEvalResult:
    """Greedy evaluation on fixed prompts."""

    success: float
    mean_reward: float
    valid_tool_call_rate: float
    mean_response_tokens: float
    episodes: list


Callback = Callable[[dict[str, float], int], Any]


class GRPO:
    """Learner (this process: base model + LoRA, AdamW) and rollout workers (Ray actors or in-process)."""

    def __init__(self, config: GRPOConfig, seed: int = 0, workers: int = 1, backend: str = "ray", env: Any = None):
        """``env``: the text env when it is not ``config.task``'s name (a factory or an instance, in-process)."""
        from opentinker.agents.multi_lora import MultiLoraModel
        from opentinker.envs.text_tasks import make_text_env

        if backend not in ("ray", "local"):
            raise ValueError(f"backend: expected 'ray' or 'local', got {backend!r}")
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers: expected an integer >= 1, got {workers!r}")
        self.config, self.seed, self.workers, self.backend = config, seed, workers, backend
        self.env = config.task if env is None else env
        self.model = MultiLoraModel(config.base_model, config.cache_dir)
        self.model.add(POLICY, config.lora, seed)
        self.params = [p for p in self.model.model.parameters() if p.requires_grad]
        """The adapter's tensors in module order (the order of the optimiser state in GRPO's checkpoints)."""
        self.optimizer = torch.optim.AdamW(self.params, lr=config.learning_rate, weight_decay=0.0)
        self.sampler = PromptSampler(len(make_text_env(self.env, "train", config.task_seed).examples), seed)
        self.trainer_rng = np.random.default_rng(seed)
        self.iteration = 0
        self.completions = 0
        self.pool: Any = None

    @property
    def updates(self) -> int:
        """Optimiser updates so far (GRPO's budget counts these, not env steps)."""
        return self.iteration

    # -- workers -------------------------------------------------------------------------------------------------
    def _pool(self) -> Any:
        if self.pool is None:
            from opentinker.agents.lm_rollout import LLMRolloutWorker
            from opentinker.envs.remote_env import actor_pool

            c = self.config
            args = [(self.env, c.task_seed, c.base_model, c.lora, c.cache_dir)] * self.workers
            self.pool = actor_pool(self.backend, LLMRolloutWorker, args)
        return self.pool

    def _split(self, items: list) -> list[list]:
        """Contiguous, near-equal shares of ``items`` per worker (the result does not depend on the split)."""
        n = len(self._pool_workers())
        bounds = np.linspace(0, len(items), n + 1).round().astype(int)
        return [items[bounds[i] : bounds[i + 1]] for i in range(n)]

    def _pool_workers(self) -> list:
        pool = self._pool()
        return pool.actors if hasattr(pool, "actors") else pool.workers

    def rollout(self, iteration: int, indices: list[int]) -> tuple[list, int]:
        """The step's episodes (ordered by group) and the adapter bytes sent to each worker."""
        c = self.config
        adapter = self.model.state(POLICY)
        groups = list(enumerate(indices))
        shares = self._split(groups)
        results = self._pool().call(
            "collect",
            [(iteration, self.seed, share, c.group_size, c.max_new_tokens, c.temperature) for share in shares],
            broadcast=(adapter,),
        )
        return [e for part in results for e in part], sum(t.numel() * t.element_size() for t in adapter.values())

    # -- learning ------------------------------------------------------------------------------------------------
    def _iterate(self) -> dict[str, float]:
        c = self.config
        started = time.perf_counter()
        indices = self.sampler.draw(c.prompts_per_step)
        episodes, sent = self.rollout(self.iteration, indices)
        rollout_s = time.perf_counter() - started
        rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32).view(len(indices), c.group_size)
        advantages = group_advantages(rewards, c.scale_rewards).flatten()
        stats = self.update(episodes, advantages)
        elapsed = time.perf_counter() - started
        self.completions += len(episodes)
        generated = sum(len(t.completion_ids) for e in episodes for t in e.turns)
        calls = sum(e.tool_calls + e.invalid_tool_calls for e in episodes)
        return {
            "train/reward_mean": float(rewards.mean()),
            "train/reward_std": float(rewards.std()),
            "train/success_rate": float(np.mean([e.success for e in episodes])),
            "train/valid_tool_call_rate": float(sum(e.tool_calls for e in episodes) / calls) if calls else 1.0,
            "train/tool_calls_per_episode": calls / len(episodes),
            "train/response_tokens": generated / len(episodes),
            "train/tokens_per_s": generated / rollout_s,
            "train/completions_per_s": len(episodes) / elapsed,
            "train/seconds_per_step": elapsed,
            "train/rollout_seconds": rollout_s,
            "train/adapter_bytes_sent": float(sent * len(self._pool_workers())),
            "train/groups_with_signal": float((rewards.std(dim=1) > 0).float().mean()),
            **stats,
        }

    def update(self, episodes: list, advantages: torch.Tensor) -> dict[str, float]:
        """``update_epochs`` optimiser steps on every generated turn of ``episodes``."""
        c = self.config
        samples = [
            (t.prompt_ids, t.completion_ids, float(a))
            for e, a in zip(episodes, advantages)
            for t in e.turns
            if t.completion_ids
        ]
        n_tokens, n_sequences = float(sum(len(s[1]) for s in samples)), len(samples)
        if c.kl_coef == 0:  # a zero-advantage sample adds nothing to the loss or its gradient: skip its passes
            samples = [s for s in samples if s[2] != 0.0]
        if not samples:
            return {"train/loss": 0.0, "train/kl": 0.0, "train/clip_fraction": 0.0, "train/grad_norm": 0.0}
        chunks = [samples[i : i + c.micro_batch] for i in range(0, len(samples), c.micro_batch)]
        with torch.no_grad():
            ref = [self._logprobs(ch, None)[0] if c.kl_coef > 0 else None for ch in chunks]
            old = [self._logprobs(ch)[0] if c.update_epochs > 1 else None for ch in chunks]
        totals = {"loss": 0.0, "kl": 0.0, "clipped": 0.0}
        for _ in range(c.update_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for chunk, ref_lp, old_lp in zip(chunks, ref, old):
                logp, mask = self._logprobs(chunk)
                adv = torch.tensor([s[2] for s in chunk]).unsqueeze(1)
                old_lp = logp.detach() if old_lp is None else old_lp
                per_token, kl = token_loss(logp, old_lp, ref_lp, adv, c.clip_range, c.kl_coef)
                loss = reduce_loss(per_token, mask, c.loss_norm, n_tokens, n_sequences)
                loss.backward()
                totals["loss"] += float(loss.detach()) / c.update_epochs
                totals["kl"] += float((kl * mask).sum()) / n_tokens / c.update_epochs
                ratio = torch.exp(logp.detach() - old_lp)
                clipped = ((ratio - 1).abs() > c.clip_range) * mask
                totals["clipped"] += float(clipped.sum()) / n_tokens / c.update_epochs
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, c.max_grad_norm)
            self.optimizer.step()
        return {
            "train/loss": totals["loss"],
            "train/kl": totals["kl"],
            "train/clip_fraction": totals["clipped"],
            "train/grad_norm": float(grad_norm),
        }

    def _logprobs(self, chunk: list, adapter: str | None = POLICY) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's completion log-probabilities and mask under ``adapter`` (None: the base model, the KL's
        reference)."""
        return completion_logprobs(self.model, adapter, [s[0] for s in chunk], [s[1] for s in chunk])

    def train(
        self,
        updates: int,
        callback: Callback | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
    ) -> dict[str, float]:
        """Optimiser updates until ``self.updates >= updates`` (``agents.trainer.train_loop``: the callback gets the
        update count, checkpoints every ``checkpoint_every`` updates)."""
        updates = check_train_args(updates, checkpoint_dir, checkpoint_every)
        return train_loop(
            self, self._iterate, updates, callback, checkpoint_dir, checkpoint_every, progress=lambda: self.updates
        )

    def evaluate(self, split: str = "heldout", prompts: int | None = None, base: bool = False) -> LLMEvalResult:
        """Greedy episodes on the first ``prompts`` examples of ``split`` (``base``: adapter disabled)."""
        c = self.config
        indices = list(range(prompts or c.eval_prompts))
        shares = self._split(indices)
        adapter = None if base else self.model.state(POLICY)
        parts = self._pool().call(
            "evaluate", [(split, share, c.max_new_tokens, c.eval_batch) for share in shares], broadcast=(adapter,)
        )
        return summarise([e for part in parts for e in part])

    # -- persistence ---------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        return atomic_save(
            {
                "config": dataclasses.asdict(self.config),
                "seed": self.seed,
                "iteration": self.iteration,
                "completions": self.completions,
                "adapter": self.model.state(POLICY),
                "optimizer": self.optimizer.state_dict(),
                "sampler": self.sampler.state(),
                "rng": rng_state(self.trainer_rng),
            },
            path,
        )

    @classmethod
    def load(cls, path: str | os.PathLike, workers: int = 1, backend: str = "ray", env: Any = None) -> GRPO:
        """Rebuild from ``save`` (``env``: as given to the constructor, when not the config's task name)."""
        state = load_checkpoint(path)
        trainer = cls(GRPOConfig(**state["config"]), seed=state["seed"], workers=workers, backend=backend, env=env)
        trainer.model.load_state(POLICY, state["adapter"])
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.sampler = PromptSampler(trainer.sampler.n, trainer.seed, **state["sampler"])
        trainer.iteration, trainer.completions = state["iteration"], state["completions"]
        restore_rng_state(state["rng"], trainer.trainer_rng)
        return trainer

    def save_adapter(self, directory: str | os.PathLike, **meta: Any) -> Path:
        """The adapter as a peft folder (``MultiLoraModel.save``): what the registry and the agent service load."""
        return self.model.save(
            POLICY,
            directory,
            task=self.config.task,
            task_seed=self.config.task_seed,
            max_new_tokens=self.config.max_new_tokens,
            **meta,
        )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


def summarise(episodes: list) -> LLMEvalResult:
    calls = sum(e.tool_calls + e.invalid_tool_calls for e in episodes)
    return LLMEvalResult(
        success=float(np.mean([e.success for e in episodes])),
        mean_reward=float(np.mean([e.reward for e in episodes])),
        valid_tool_call_rate=(sum(e.tool_calls for e in episodes) / calls) if calls else 1.0,
        mean_response_tokens=float(np.mean([sum(len(t.completion_ids) for t in e.turns) for e in episodes])),
        episodes=episodes,
    )
