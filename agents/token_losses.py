"""The per-token losses a client names in a Tinker ``forward_backward`` (``loss_fn``), for one sequence.

Each takes ``logp``, the learner's log-probability of every target token (with its graph), and the datum's other
inputs, and returns per-token losses whose SUM is the datum's loss. Tinker sums over tokens and datums and never
averages: a client normalises through ``weights`` or ``advantages``. With ``ratio = exp(logp - q)`` (``q``: the
sampler's ``logprobs``), ``A`` the ``advantages`` and ``w`` the ``weights``:

    cross_entropy        -w * logp
    importance_sampling  -ratio * A                                        (REINFORCE, off-policy corrected)
    ppo                  -min(ratio * A, clip(ratio, low, high) * A)       (Schulman et al. 2017)
    stable_reinforce     ppo's, q being the logprobs the server recorded when it sampled the tokens
    cispo                -sg(clip(ratio, low, high)) * logp * A            (MiniMax-M1; sg: no gradient)
    dro                  -(logp * A - beta / 2 * (logp - q)^2)             (Richemond et al. 2024)

``clipped_ratio`` is the one clipped-ratio surrogate: ppo's, stable_reinforce's and the built-in GRPO's
(``agents.grpo.token_loss``). stable_reinforce is ppo's maths on the sampler's own logprobs: the server fills
``logprobs`` from what it recorded at sampling time (``record_stability_info``; ``opentinker.server.tinker.stability``)
and zeroes the advantages of tokens it did not sample, so here it is one more name for that loss.

``LOSSES`` says which inputs each needs and which ``loss_fn_config`` keys it takes; ``check_datum`` and
``check_config`` turn a bad request into one line naming the field. Defaults: ppo and stable_reinforce clip to
[0.8, 1.2] (Tinker's documented epsilon 0.2), cispo to [0.0, 4.0] (no lower bound, as the paper), dro's beta is 0.05.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

LossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor]


class LossInputError(ValueError):
    """A request the loss cannot run on: the message names the field and what was expected."""


def cross_entropy(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]) -> torch.Tensor:
    weights = inputs.get("weights")
    return -logp if weights is None else -weights * logp


def importance_sampling(
    logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    ratio = torch.exp(logp - inputs["logprobs"])
    return -ratio * inputs["advantages"]


def clipped_ratio(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    """Per-token ``-min(ratio * A, clip(ratio, low, high) * A)``, ``ratio = exp(logp - old_logp)``: PPO's clipped
    surrogate (``advantages`` broadcast over ``logp``)."""
    ratio = torch.exp(logp - old_logp)
    return -torch.min(ratio * advantages, torch.clamp(ratio, low, high) * advantages)


def ppo(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]) -> torch.Tensor:
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    return clipped_ratio(logp, inputs["logprobs"], inputs["advantages"], low, high)


def cispo(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]) -> torch.Tensor:
    ratio = torch.exp(logp - inputs["logprobs"])
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"]).detach()
    return -clipped * logp * inputs["advantages"]


def dro(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]) -> torch.Tensor:
    penalty = (logp - inputs["logprobs"]) ** 2
    return -(logp * inputs["advantages"] - 0.5 * config["beta"] * penalty)


@dataclass(frozen=True)
class LossSpec:
    """One loss: its function, the ``loss_fn_inputs`` it needs / may take, its config keys and their defaults."""

    fn: LossFn
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    defaults: Mapping[str, float] | None = None


_CLIP_PPO = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
_CLIP_CISPO = {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
_RL_INPUTS = ("target_tokens", "logprobs", "advantages")

LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, ("target_tokens",), optional=("weights",)),
    "importance_sampling": LossSpec(importance_sampling, _RL_INPUTS),
    "ppo": LossSpec(ppo, _RL_INPUTS, defaults=_CLIP_PPO),
    "cispo": LossSpec(cispo, _RL_INPUTS, defaults=_CLIP_CISPO),
    "dro": LossSpec(dro, _RL_INPUTS, defaults={"beta": 0.05}),
    "stable_reinforce": LossSpec(ppo, _RL_INPUTS, defaults=_CLIP_PPO),
}
UNSUPPORTED = {
    "gspo": "needs sequence-level importance ratios this server does not compute",
    "custom": "server-side custom losses are not supported: forward_backward_custom runs them client-side",
}
"""Loss names the SDK knows that this server refuses, and why (``loss_spec``'s error says it)."""

FLOAT_INPUTS = ("weights", "logprobs", "advantages")


def loss_spec(name: str) -> LossSpec:
    """The spec of ``name``; an unknown or unsupported loss is a ``LossInputError`` saying what is supported."""
    if name in LOSSES:
        return LOSSES[name]
    known = ", ".join(LOSSES)
    why = f" ({UNSUPPORTED[name]})" if name in UNSUPPORTED else ""
    raise LossInputError(f"loss_fn: {name!r} is not supported by this server{why}; supported: {known}")


def check_config(name: str, config: Mapping[str, object] | None) -> dict[str, float]:
    """The loss's config: its defaults overridden by ``config``; an unknown key or a non-number is an error."""
    spec = loss_spec(name)
    resolved = dict(spec.defaults or {})
    for key, value in (config or {}).items():
        if key not in resolved:
            allowed = ", ".join(resolved) or "none"
            raise LossInputError(f"loss_fn_config[{key!r}]: not a parameter of {name} (its parameters: {allowed})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
            raise LossInputError(f"loss_fn_config[{key!r}]: expected a finite number, got {value!r}")
        resolved[key] = float(value)
    low, high = resolved.get("clip_low_threshold"), resolved.get("clip_high_threshold")
    if low is not None and high is not None and not 0.0 <= low <= 1.0 <= high:
        raise LossInputError(
            f"loss_fn_config: expected 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got {low}, {high}"
        )
    return resolved


def check_datum(name: str, index: int, n_tokens: int, inputs: Mapping[str, np.ndarray], vocab_size: int) -> None:
    """One datum's ``loss_fn_inputs`` against the loss: the inputs it needs, nothing else, shapes that line up with
    ``target_tokens`` (whose first dimension is the model input's length), token ids inside the vocabulary, finite
    floats."""
    spec = loss_spec(name)
    where = f"data[{index}].loss_fn_inputs"
    missing = [key for key in spec.required if key not in inputs]
    if missing:
        raise LossInputError(f"{where}: {name} needs {', '.join(spec.required)}; missing {', '.join(missing)}")
    extra = sorted(set(inputs) - set(spec.required) - set(spec.optional))
    if extra:
        allowed = ", ".join(spec.required + spec.optional)
        raise LossInputError(f"{where}[{extra[0]!r}]: not an input of {name} (its inputs: {allowed})")
    targets = inputs["target_tokens"]
    if targets.ndim not in (1, 2) or targets.shape[0] != n_tokens:
        raise LossInputError(
            f"{where}['target_tokens']: expected shape ({n_tokens},) or ({n_tokens}, K) to match the "
            f"{n_tokens} model_input tokens, got {tuple(targets.shape)}"
        )
    if targets.ndim == 2 and name != "cross_entropy":
        raise LossInputError(
            f"{where}['target_tokens']: {name} takes one target per position, got shape {targets.shape}"
        )
    if not np.issubdtype(targets.dtype, np.integer):
        raise LossInputError(f"{where}['target_tokens']: expected int64 token ids, got {targets.dtype}")
    if targets.size and (targets.min() < 0 or targets.max() >= vocab_size):
        raise LossInputError(
            f"{where}['target_tokens']: token ids must be in [0, {vocab_size}), got {targets.min()}..{targets.max()}"
        )
    for key in FLOAT_INPUTS:
        if key not in inputs:
            continue
        value = inputs[key]
        if value.shape != targets.shape:
            raise LossInputError(
                f"{where}[{key!r}]: expected the shape of target_tokens {tuple(targets.shape)}, "
                f"got {tuple(value.shape)}"
            )
        if not np.issubdtype(value.dtype, np.floating) or not np.isfinite(value).all():
            raise LossInputError(f"{where}[{key!r}]: expected finite float32 values")


def gradient_positions(name: str, inputs: Mapping[str, np.ndarray], config: Mapping[str, float]) -> np.ndarray:
    """The positions where ``name``'s per-token loss depends on logp (elsewhere it is zero whatever logp is, so
    those positions need no gradient): a non-zero weight for cross_entropy, a non-zero advantage for the
    policy-gradient losses, everywhere for dro (its penalty pulls logp towards the sampler's at every position)."""
    n = inputs["target_tokens"].shape[0]
    if name == "cross_entropy":
        weights = inputs.get("weights")
        return np.ones(n, dtype=bool) if weights is None else (weights.reshape(n, -1) != 0).any(axis=1)
    if name == "dro" and config.get("beta", 0.0) != 0:
        return np.ones(n, dtype=bool)
    return inputs["advantages"] != 0


def datum_loss(
    name: str, logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    """The datum's loss (a scalar with the graph of ``logp``): the sum of ``name``'s per-token losses."""
    return LOSSES[name].fn(logp, inputs, config).sum()
