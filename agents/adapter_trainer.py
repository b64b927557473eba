"""One client's LoRA adapter under training on a shared ``MultiLoraModel``: what Tinker's ``forward_backward``,
``forward`` and ``optim_step`` do to it.

``forward_backward`` adds the gradient of the batch's loss (the sum over datums of the loss's per-token sum,
``agents.token_losses``) to the adapter's tensors; calls accumulate until ``optim_step`` applies AdamW (decoupled
weight decay, the step's own hyper-parameters, optional global-norm clipping) and clears them. Every client has its
own optimiser state; ``state_dict`` holds the adapter, the optimiser and the step count, so a load resumes the run
bit for bit (gradients not yet applied are not part of it).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from opentinker.agents.multi_lora import AdapterShape, MultiLoraModel
from opentinker.agents.token_losses import LossInputError, check_config, check_datum, datum_loss, gradient_positions

MICRO_BATCH_TOKENS = 4096
"""Padded tokens per forward/backward pass: gradients accumulate across passes (memory, not maths)."""


@dataclass(frozen=True)
class TokenDatum:
    """One training sequence: the model's input tokens and its loss inputs (``target_tokens`` first, numpy)."""

    tokens: Sequence[int]
    inputs: Mapping[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class AdamStep:
    """One optimiser step's hyper-parameters (Tinker's ``AdamParams``; torch's AdamW with these values)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    """Global gradient-norm limit; 0 disables clipping."""

    def __post_init__(self) -> None:
        checks = {
            "learning_rate": (self.learning_rate >= 0, ">= 0"),
            "beta1": (0 <= self.beta1 < 1, "in [0, 1)"),
            "beta2": (0 <= self.beta2 < 1, "in [0, 1)"),
            "eps": (self.eps > 0, "> 0"),
            "weight_decay": (self.weight_decay >= 0, ">= 0"),
            "grad_clip_norm": (self.grad_clip_norm >= 0, ">= 0 (0 disables clipping)"),
        }
        for name, (ok, expected) in checks.items():
            value = getattr(self, name)
            if not math.isfinite(value) or not ok:
                raise ValueError(f"adam_params.{name} must be {expected}, got {value!r}")


@dataclass(frozen=True)
class ForwardResult:
    """Per-datum target log-probabilities (the shape of each ``target_tokens``) and the batch's summed loss."""

    logprobs: list[np.ndarray]
    loss: float
    tokens: int


class AdapterTrainer:
    """The adapter ``name`` on ``model`` with its own AdamW state."""

    def __init__(self, model: MultiLoraModel, name: str, shape: AdapterShape, seed: int | None = None):
        self.model, self.name, self.shape = model, name, shape
        model.add(name, shape, seed)
        step = AdamStep()
        self.optimizer = torch.optim.AdamW(
            model.parameters(name),
            lr=step.learning_rate,
            betas=(step.beta1, step.beta2),
            eps=step.eps,
            weight_decay=step.weight_decay,
        )
        self.steps = 0

    def check(self, data: Sequence[TokenDatum], loss: str, config: Mapping[str, object] | None) -> dict[str, float]:
        """The resolved loss config, after checking every datum (nothing runs on a batch with one bad datum)."""
        if not data:
            raise LossInputError("data: expected at least one datum")
        resolved = check_config(loss, config)
        for index, datum in enumerate(data):
            n = len(datum.tokens)
            if n == 0:
                raise LossInputError(f"data[{index}].model_input: expected at least one token")
            if n > self.model.max_context:
                raise LossInputError(
                    f"data[{index}].model_input: {n} tokens is longer than the model's context of "
                    f"{self.model.max_context}"
                )
            tokens = np.asarray(datum.tokens)
            if tokens.min() < 0 or tokens.max() >= self.model.vocab_size:
                raise LossInputError(f"data[{index}].model_input: token ids must be in [0, {self.model.vocab_size})")
            check_datum(loss, index, n, datum.inputs, self.model.vocab_size)
        return resolved

    def forward_backward(
        self,
        data: Sequence[TokenDatum],
        loss: str,
        config: Mapping[str, object] | None = None,
        forward_only: bool = False,
    ) -> ForwardResult:
        """The loss and target log-probabilities of ``data``; unless ``forward_only``, its gradient is added."""
        resolved = self.check(data, loss, config)
        return forward_backward_many([Part(self, data, loss, resolved)], forward_only)[0]

    def optim_step(self, step: AdamStep) -> dict[str, float]:
        """Apply the accumulated gradients with ``step``'s AdamW settings; returns the pre-clip gradient norm."""
        params = self.model.parameters(self.name)
        limit = step.grad_clip_norm if step.grad_clip_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], limit))
        for group in self.optimizer.param_groups:
            group.update(
                lr=step.learning_rate, betas=(step.beta1, step.beta2), eps=step.eps, weight_decay=step.weight_decay
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm": grad_norm, "learning_rate": step.learning_rate, "step": float(self.steps)}

    def state_dict(self) -> dict[str, Any]:
        """Everything a bit-exact resume needs (adapter, optimiser, step count) and what the adapter is."""
        return {
            "base_model": self.model.base,
            "shape": vars(self.shape).copy(),
            "adapter": self.model.state(self.name),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),  # torch hands out its live tensors
            "steps": self.steps,
        }

    def load_state_dict(self, state: Mapping[str, Any], optimizer: bool = True) -> None:
        """The adapter of ``state`` (and, with ``optimizer``, its optimiser state and step count); pending gradients
        are dropped."""
        if AdapterShape(**state["shape"]) != self.shape:
            raise ValueError(f"checkpoint: its adapter is {state['shape']}, this model's is {vars(self.shape)}")
        self.optimizer.zero_grad(set_to_none=True)
        self.model.load_state(self.name, state["adapter"])
        if optimizer:
            self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
            self.steps = int(state["steps"])

    def close(self) -> None:
        """Free the adapter and the optimiser state."""
        self.optimizer.state.clear()
        self.model.remove(self.name)


@dataclass(frozen=True)
class Part:
    """One client's share of a batch: its trainer, its datums, its loss and the loss's resolved config
    (``AdapterTrainer.check``)."""

    trainer: AdapterTrainer
    data: Sequence[TokenDatum]
    loss: str
    config: Mapping[str, float]


def forward_backward_many(parts: Sequence[Part], forward_only: bool = False) -> list[ForwardResult]:
    """Several clients' ``forward_backward`` on one base model in shared passes: rows of different adapters go
    through the decoder together (peft's mixed batch), each row's loss is its own client's, and the backward of
    their sum gives each adapter the gradient of its own rows, as if it had run alone. One result per part."""
    model = parts[0].trainer.model
    if any(part.trainer.model is not model for part in parts):
        raise ValueError("forward_backward_many: every part must train an adapter of the same base model")
    rows = [(index, datum) for index, part in enumerate(parts) for datum in part.data]
    logprobs: list[list[np.ndarray]] = [[] for _ in parts]
    totals, tokens = [0.0] * len(parts), [0] * len(parts)
    for chunk in _chunks(rows, MICRO_BATCH_TOKENS):
        with torch.set_grad_enabled(not forward_only):
            owners = [index for index, _ in chunk]
            data = [datum for _, datum in chunk]
            targets = [torch.as_tensor(d.inputs["target_tokens"], dtype=torch.long) for d in data]
            active = [
                torch.as_tensor(gradient_positions(parts[i].loss, d.inputs, parts[i].config))
                for i, d in zip(owners, data)
            ]
            names = [parts[i].trainer.name for i in owners]
            logps = model.target_logprobs(names, [d.tokens for d in data], targets, active)
            losses = [
                datum_loss(parts[i].loss, logp, _float_inputs(d, logp.device), parts[i].config)
                for i, d, logp in zip(owners, data, logps)
            ]
            chunk_loss = torch.stack(losses).sum()
        if not forward_only and chunk_loss.requires_grad:  # no graph: no position of the chunk has a gradient
            chunk_loss.backward()
        for i, datum_loss_value, target, logp in zip(owners, losses, targets, logps):
            totals[i] += float(datum_loss_value.detach())
            tokens[i] += target.numel()
            logprobs[i].append(logp.detach().to("cpu", torch.float32).numpy())
    return [ForwardResult(logprobs=logprobs[i], loss=totals[i], tokens=tokens[i]) for i in range(len(parts))]


def _float_inputs(datum: TokenDatum, device: torch.device) -> dict[str, torch.Tensor]:
    return {
        k: torch.as_tensor(v, dtype=torch.float32, device=device)
        for k, v in datum.inputs.items()
        if k != "target_tokens"
    }


def _chunks(rows: Sequence[tuple[int, TokenDatum]], budget: int) -> list[list[tuple[int, TokenDatum]]]:
    """Consecutive ``(owner, datum)`` rows whose padded size (rows x longest) stays within ``budget`` tokens (at
    least one each)."""
    chunks: list[list[tuple[int, TokenDatum]]] = []
    current: list[tuple[int, TokenDatum]] = []
    longest = 0
    for row in rows:
        longest_with = max(longest, len(row[1].tokens))
        if current and longest_with * (len(current) + 1) > budget:
            chunks.append(current)
            current, longest_with = [], len(row[1].tokens)
        current.append(row)
        longest = longest_with
    if current:
        chunks.append(current)
    return chunks
