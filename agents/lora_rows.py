"""peft's mixed batch (``adapter_names``: one adapter per row) at the cost of one batch, when each adapter's rows are
consecutive, as in a training batch of several clients (``adapter_trainer.forward_backward_many``) and most sampling
batches.

peft's own ``lora.Linear._mixed_batch_forward`` gathers each adapter's rows out of the layer's input and adds its
output back into the full result by index: forward and backward, every adapter touches a tensor of the whole batch
(the backward of an indexing allocates and fills one), so a pass's cost grows with adapters x rows. On SmolLM2 on
CPU, one ``forward_backward`` of 4 clients' 8 rows cost 1.6x four passes of 8 rows (21.8 vs 13.4 s) and a single
adapter's 32 rows 13.3 s: sharing a pass lost time. Here the input is split into its runs of rows (views), each run
goes through its adapter, the deltas are concatenated and added once: adapters x rank, not adapters x rows.
"""

from __future__ import annotations

from typing import Any

import torch


def install() -> None:
    """Make peft's LoRA ``Linear`` layers use ``grouped_forward`` for mixed batches (idempotent)."""
    from peft.tuners.lora import layer

    if getattr(layer.Linear._mixed_batch_forward, "grouped", False):
        return
    fallback = layer.Linear._mixed_batch_forward

    def mixed_batch_forward(module: Any, x: torch.Tensor, *args: Any, adapter_names: list[str], **kwargs: Any):
        runs = _runs(adapter_names)
        variants = any(name in module.lora_variant for name, _ in runs)
        if (
            len(runs) > len(set(adapter_names))
            or variants
            or any(kwargs.get(k) is not None for k in layer.VARIANT_KWARG_KEYS)
        ):
            return fallback(module, x, *args, adapter_names=adapter_names, **kwargs)
        for key in layer.VARIANT_KWARG_KEYS:
            kwargs.pop(key, None)
        return grouped_forward(module, x, runs, *args, **kwargs)

    mixed_batch_forward.grouped = True
    layer.Linear._mixed_batch_forward = mixed_batch_forward


def grouped_forward(module: Any, x: torch.Tensor, runs: list[tuple[str, int]], *args: Any, **kwargs: Any):
    """The base layer on all rows, plus each run's LoRA delta on its own rows (``runs``: (adapter, rows) in order)."""
    result = module.base_layer(x, *args, **kwargs)
    if all(name not in module.lora_A for name, _ in runs):  # the base model's rows (multi_lora.BASE) have none
        return result
    deltas = []
    for (name, _), rows in zip(runs, x.split([n for _, n in runs])):
        if name not in module.lora_A:
            deltas.append(result.new_zeros(rows.shape[:-1] + result.shape[-1:]))
            continue
        lora_a, lora_b = module.lora_A[name], module.lora_B[name]
        delta = lora_b(lora_a(module.lora_dropout[name](rows.to(lora_a.weight.dtype)))) * module.scaling[name]
        deltas.append(delta.to(result.dtype))
    return result + torch.cat(deltas)


def _runs(names: list[str]) -> list[tuple[str, int]]:
    """Consecutive equal names as (name, count)."""
    runs: list[tuple[str, int]] = []
    for name in names:
        if runs and runs[-1][0] == name:
            runs[-1] = (name, runs[-1][1] + 1)
        else:
            runs.append((name, 1))
    return runs
