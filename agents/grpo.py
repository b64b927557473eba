"""GRPO (Shao et al. 2024, DeepSeekMath) for a language-model policy on a text task, LoRA adapter only: the loss
(its config, ``GRPOConfig``, sits with the others in ``agents/config.py``; the trainer: ``agents/grpo_trainer.py``).

Each step: draw ``prompts_per_step`` train prompts; rollout workers sample ``group_size`` episodes per prompt;
every episode's reward is normalised within its group (the group is the baseline, no value network):

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)        (``scale_rewards=False``: no division)

and every token the model generated in that episode (all its turns; tool results are context, not trained) gets A_i.
The loss per token is PPO's clipped surrogate plus a KL penalty towards the frozen base model — the same network
with the adapter disabled, so no second copy is kept — using the k3 estimator (Schulman 2020):

    L_t = -min(rho_t A, clip(rho_t, 1 - eps, 1 + eps) A) + beta (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)

``loss_norm`` chooses how tokens are averaged: ``"token"`` divides the sum over all tokens of the batch by their
count (DAPO; long and short completions weigh the same per token; TRL's ``loss_type="bnpo"``), ``"sequence"``
averages within each completion, then over completions (the paper's 1/|o_i|; TRL's ``"grpo"``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from opentinker.agents.config import GRPOConfig
from opentinker.agents.token_losses import clipped_ratio


def grpo_config(overrides: dict[str, Any]) -> GRPOConfig:
    """A config from a dict; an unknown key is an error naming it and the known ones."""
    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown GRPOConfig field {unknown[0]!r} (expected one of: {', '.join(sorted(known))})")
    return GRPOConfig(**overrides)


def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """Rewards shaped (groups, group_size) → advantages of the same shape (zero for a group of equal rewards)."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    return centred / (rewards.std(dim=1, keepdim=True) + eps) if scale else centred


def token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    clip_range: float,
    kl_coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token GRPO loss and KL (shapes like ``logp``); ``advantages`` broadcast over tokens. The surrogate is
    the Tinker ``ppo`` loss's (``token_losses.clipped_ratio``) with the band ``1 -/+ clip_range``."""
    policy_loss = clipped_ratio(logp, old_logp, advantages, 1 - clip_range, 1 + clip_range)
    if ref_logp is None:
        kl = torch.zeros_like(logp)
    else:
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1
    return policy_loss + kl_coef * kl, kl


def reduce_loss(
    per_token: torch.Tensor, mask: torch.Tensor, norm: str, n_tokens: float, n_sequences: int
) -> torch.Tensor:
    """Sum of this micro-batch's share of the batch loss (``n_tokens``/``n_sequences``: whole-batch counts)."""
    per_token = per_token * mask
    if norm == "token":
        return per_token.sum() / n_tokens
    return (per_token.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / n_sequences


def completion_logprobs(
    model: Any, adapter: str | None, prompts: list[list[int]], completions: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(completion token | everything before) for a batch, from ``MultiLoraModel.target_logprobs`` (the Tinker
    engine's forward; ``adapter`` None: the base model): (batch, longest completion) and its mask. The output layer
    runs on the completions' positions only."""
    rows = model.target_logprobs(
        adapter,
        [p + c[:-1] for p, c in zip(prompts, completions)],
        [torch.as_tensor(c, dtype=torch.long) for c in completions],
        offsets=[len(p) - 1 for p in prompts],
    )
    logp = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    lengths = torch.tensor([len(c) for c in completions], device=logp.device)
    return logp, (torch.arange(logp.shape[1], device=logp.device) < lengths.unsqueeze(1)).float()
