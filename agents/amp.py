"""Mixed precision for the learner: ``amp_mode`` in off / bf16 / fp16 / safe / auto.

``safe`` runs bf16 autocast (fp16 with loss scaling on GPUs without bf16) and checks every loss and gradient;
the first non-finite one skips that optimiser step and switches the rest of the run to fp32, recording why.
``auto`` (SAC's and TD3's default) is bf16 autocast where the hardware multiplies bf16 natively (CUDA GPUs with bf16,
CPUs with AVX512-BF16 or AMX) and fp32 elsewhere, without per-step checks: bf16 keeps fp32's exponent range, so it
overflows no sooner than fp32; it trades the precision of the products (8 bits of mantissa, accumulated in fp32) for
about 3.5x faster matmuls on such a CPU. Learners whose step is a few large matmuls gain; small MLPs (PPO, DQN) do not.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch

AMP_MODES = ("off", "bf16", "fp16", "safe", "auto")
log = logging.getLogger("opentinker.agents")


@contextlib.contextmanager
def _subnormals_flushed() -> Iterator[None]:
    """Subnormal floats flushed to zero (on CPU, in this thread) for the optimiser step, then the default again.

    Adam's second-moment estimates of tiny gradients decay into subnormals, which x86 CPUs compute ~10x slower: a
    CartPole DQN spent half its update time in 67k-parameter Adam steps (0.54 ms each, 0.05 ms flushed). GPU kernels
    flush them by default; values below 1e-38 carry nothing an optimiser step needs."""
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


class AmpNaNError(FloatingPointError):
    """A non-finite loss or gradient under ``amp_mode`` bf16/fp16: a mixed-precision conflict."""


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 matrix products run natively on ``device`` (emulated ones are slower than fp32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


class AmpController:
    def __init__(self, mode: str, device: torch.device):
        if mode not in AMP_MODES:
            raise ValueError(f"amp_mode must be one of {AMP_MODES}, got {mode!r}")
        self.requested = mode  # what checkpoints keep; ``mode`` is what runs here (``auto`` resolved)
        if mode == "auto":
            mode = "bf16" if native_bf16(device) else "off"
        self.mode, self.device_type = mode, device.type
        bf16_ok = device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_bf16_supported())
        self.dtype = torch.float16 if mode == "fp16" or (mode == "safe" and not bf16_ok) else torch.bfloat16
        self.scaler = torch.amp.GradScaler(device.type, enabled=mode != "off" and self.dtype == torch.float16)
        self.fallback_reason: str | None = None
        self.skipped_steps = 0

    @property
    def active(self) -> bool:
        return self.mode != "off" and self.fallback_reason is None

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.active)

    def _fall_back(self, reason: str, optimizer: torch.optim.Optimizer) -> bool:
        self.fallback_reason = reason
        self.skipped_steps += 1
        optimizer.zero_grad(set_to_none=True)
        self.scaler = torch.amp.GradScaler(self.device_type, enabled=False)
        log.warning("amp_mode=safe: %s; step skipped, continuing in fp32", reason)
        return False

    def _conflict(self, what: str) -> AmpNaNError:
        return AmpNaNError(
            f"{what} under amp_mode={self.mode!r} ({self.dtype}): a mixed-precision conflict. "
            "Set amp_mode='safe' (checks every step, skips a non-finite one and continues in fp32) "
            "or amp_mode='off'"
        )

    def step(
        self,
        loss: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        params: list[torch.nn.Parameter],
        max_grad_norm: float | None,
        reduce: Callable[[list[torch.nn.Parameter]], None] | None = None,
    ) -> bool:
        """Backward, clip (unless ``max_grad_norm`` is None) and apply one update; False when the step was skipped
        (safe mode fallback).

        ``reduce(params)`` averages the gradients across learners right after backward (still scaled, so every
        learner then takes the same unscale, finite-check, clip and step decisions).

        Under bf16/fp16 a non-finite loss, or non-finite gradients that loss scaling cannot explain (bf16 has
        no scaler; fp16 once the scale is down to 1), raise ``AmpNaNError`` naming ``amp_mode='safe'``.
        """
        guard = self.mode == "safe" and self.active
        strict = self.mode in ("bf16", "fp16") and self.requested != "auto"
        if (guard or strict) and not torch.isfinite(loss).item():
            if strict:
                raise self._conflict(f"non-finite loss ({loss.item()})")
            return self._fall_back(f"non-finite loss ({loss.item()}) under {self.dtype}", optimizer)
        optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if reduce is not None:
            reduce(params)
        self.scaler.unscale_(optimizer)
        if guard and not all(torch.isfinite(p.grad).all().item() for p in params if p.grad is not None):
            return self._fall_back(f"non-finite gradients under {self.dtype}", optimizer)
        norm = None if max_grad_norm is None else torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        if (  # without clipping there is no norm to look at: the loss check above is the strict mode's check
            strict
            and norm is not None
            and not torch.isfinite(norm).item()
            and (not self.scaler.is_enabled() or self.scaler.get_scale() <= 1.0)
        ):
            raise self._conflict("non-finite gradient")
        with _subnormals_flushed():
            self.scaler.step(optimizer)
        self.scaler.update()
        return True

    def metrics(self) -> dict[str, float]:
        return {"perf/amp_active": float(self.active), "perf/amp_skipped_steps": float(self.skipped_steps)}

    def state_dict(self) -> dict:
        return {
            "fallback_reason": self.fallback_reason,
            "skipped_steps": self.skipped_steps,
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.fallback_reason, self.skipped_steps = state["fallback_reason"], state["skipped_steps"]
        if self.fallback_reason is not None:
            self.scaler = torch.amp.GradScaler(self.device_type, enabled=False)
        elif state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
