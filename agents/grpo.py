"""GRPO (Shao et al. 2024, DeepSeekMath) for a language-model policy on a text task, LoRA adapter only: the config and
the loss (the trainer that runs them: ``agents/grpo_trainer.py``).

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
from dataclasses import dataclass
from typing import Any, Literal

import torch

from opentinker.infra.checks import check_field, check_ints


@dataclass
class GRPOConfig:
    """Everything one GRPO run needs besides the seed (CleanRL style: one flat, typed config)."""

    task: str = "arithmetic"
    """A shipped text task (``envs.text_tasks.TEXT_TASKS``)."""
    base_model: str = "smollm2"
    """``"smollm2"``, ``"tiny"`` or a transformers checkpoint folder (``agents.lm_policy``)."""
    group_size: int = 8
    """Completions per prompt; the group's rewards are each other's baseline."""
    prompts_per_step: int = 4
    max_new_tokens: int = 24
    """Per reply (per turn)."""
    temperature: float = 0.7
    """SmolLM2-135M at 1.0 rambles (~0% exact answers on ``arithmetic``, no signal); 0.7 gives ~15%."""
    learning_rate: float = 5e-4
    """AdamW (no weight decay), adapter parameters only."""
    clip_range: float = 0.2
    kl_coef: float = 0.0
    """beta: weight of the KL penalty towards the base model (0, as in DAPO and TRL's default, skips its pass)."""
    loss_norm: Literal["token", "sequence"] = "token"
    scale_rewards: bool = True
    """Divide advantages by the group's reward std (Dr. GRPO argues for False)."""
    update_epochs: int = 1
    """Optimiser passes over each batch; with 1 the ratio is 1 and clipping never binds."""
    micro_batch: int = 8
    """Completions per forward/backward (gradients accumulate: memory, not maths)."""
    max_grad_norm: float = 1.0
    lora_rank: int = 16
    lora_alpha: int = 32
    task_seed: int = 0
    """Generates the task's examples and its train / held-out split."""
    eval_prompts: int = 64
    """Held-out prompts evaluated (greedy), the first ones of the split."""
    eval_batch: int = 16
    cache_dir: str | None = None
    """Where the de-quantised base model is cached (default ``<data_dir>/llm-cache``)."""

    def __post_init__(self) -> None:
        counts = ("prompts_per_step", "max_new_tokens", "update_epochs", "micro_batch", "lora_rank", "lora_alpha")
        check_ints(self, (*counts, "eval_prompts", "eval_batch"), prefix="GRPOConfig.")
        check_ints(self, ("group_size",), minimum=2, prefix="GRPOConfig.")  # a group is its own baseline
        for name in ("temperature", "kl_coef", "learning_rate", "clip_range", "max_grad_norm"):
            value = getattr(self, name)
            check_field(f"GRPOConfig.{name}", isinstance(value, (int, float)) and value >= 0, "a number >= 0", value)
        check_field(
            "GRPOConfig.temperature", self.temperature > 0, "> 0 (greedy completions are all alike)", self.temperature
        )
        check_field(
            "GRPOConfig.loss_norm", self.loss_norm in ("token", "sequence"), "'token' or 'sequence'", self.loss_norm
        )
        from opentinker.envs.text_tasks import text_task

        text_task(self.task)

    @property
    def lora(self):
        from opentinker.agents.lm_policy import LoraSpec

        return LoraSpec(rank=self.lora_rank, alpha=self.lora_alpha)


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
    """Per-token GRPO loss and KL (shapes like ``logp``); ``advantages`` broadcast over tokens."""
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.min(ratio * advantages, torch.clamp(ratio, 1 - clip_range, 1 + clip_range) * advantages)
    if ref_logp is None:
        kl = torch.zeros_like(logp)
    else:
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1
    return -surrogate + kl_coef * kl, kl


def reduce_loss(
    per_token: torch.Tensor, mask: torch.Tensor, norm: str, n_tokens: float, n_sequences: int
) -> torch.Tensor:
    """Sum of this micro-batch's share of the batch loss (``n_tokens``/``n_sequences``: whole-batch counts)."""
    per_token = per_token * mask
    if norm == "token":
        return per_token.sum() / n_tokens
    return (per_token.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / n_sequences


def completion_logprobs(
    model: Any, prompts: list[list[int]], completions: list[list[int]], pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(completion token | everything before) for a batch: (batch, longest completion) and its mask.

    Prompts are left-padded and completions right-padded, so all completions sit in the last columns and
    only those columns' logits are computed (``logits_to_keep``)."""
    width_p = max(len(p) for p in prompts)
    width_c = max(len(c) for c in completions)
    ids, attention, mask = [], [], []
    for p, c in zip(prompts, completions):
        ids.append([pad] * (width_p - len(p)) + p + c + [pad] * (width_c - len(c)))
        attention.append([0] * (width_p - len(p)) + [1] * (len(p) + len(c)) + [0] * (width_c - len(c)))
        mask.append([1.0] * len(c) + [0.0] * (width_c - len(c)))
    ids_t, attention_t = torch.tensor(ids), torch.tensor(attention)
    position_ids = (attention_t.cumsum(dim=1) - 1).clamp(min=0)
    logits = (
        model(input_ids=ids_t, attention_mask=attention_t, position_ids=position_ids, logits_to_keep=width_c + 1)
        .logits[:, :-1]
        .float()
    )
    targets = ids_t[:, width_p:]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp, torch.tensor(mask)
