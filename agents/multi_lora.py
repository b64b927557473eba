"""One base language model in memory and any number of named LoRA adapters on it (peft's multi-adapter model).

Many clients share the base weights; each owns an adapter (its own rank and target modules). Training runs one
adapter at a time (``activate`` makes only its tensors trainable); sampling can mix adapters in one batch
(peft's ``adapter_names``, ``"__base__"`` for the bare model). The peft wrapper is created with the first adapter
and unwrapped when the last one goes, so an idle model holds no LoRA layers at all.

Adapters are saved as peft's own files plus ``opentinker_llm.json`` (``save``), so a saved adapter is also what the
registry serves (``tracking.llm_store``). The Tinker engine and the built-in GRPO both train on this model.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from opentinker.agents.lm_policy import ADAPTER_META, load_base_model

LORA_ALPHA = 32
"""LoRA's alpha unless the shape names another (scale alpha / rank): the Tinker API fixes it whatever the rank, as
the hosted service does; a GRPO config may set its own (``GRPOConfig.lora_alpha``)."""
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)
BASE = "__base__"
"""peft's name for "no adapter" in a mixed batch."""


@dataclass(frozen=True)
class AdapterShape:
    """The one LoRA shape of both trainers (a Tinker client's ``create_model``, the built-in GRPO's config): the
    rank, alpha and which parts of the network train."""

    rank: int = 32
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    alpha: int = LORA_ALPHA

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 1 <= self.rank <= 512:
            raise ValueError(f"lora_config.rank must be an int in [1, 512], got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int) or self.alpha < 1:
            raise ValueError(f"lora_config.alpha must be an int >= 1, got {self.alpha!r}")
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise ValueError("lora_config: at least one of train_attn, train_mlp, train_unembed must be true")

    @property
    def targets(self) -> tuple[str, ...]:
        return (
            (ATTENTION if self.train_attn else ())
            + (MLP if self.train_mlp else ())
            + (UNEMBED if self.train_unembed else ())
        )

    def peft_config(self) -> Any:
        from peft import LoraConfig

        return LoraConfig(
            r=self.rank, lora_alpha=self.alpha, target_modules=list(self.targets), lora_dropout=0.0, bias="none"
        )


class MultiLoraModel:
    """A base model (``agents.lm_policy`` names: ``"smollm2"``, ``"tiny"`` or a checkpoint folder) and its adapters.

    Not thread-safe: one caller (the serving engine's worker) drives it. The model stays in eval mode; LoRA has no
    dropout here, so training and sampling see the same function.
    """

    def __init__(self, base: str, cache_dir: str | Path | None = None, device: str = "cpu"):
        base_model, self.tokenizer = load_base_model(base, cache_dir)
        self.base, self.device = base, torch.device(device)
        for param in base_model.parameters():
            param.requires_grad_(False)
        self._base_model = base_model.to(self.device).eval()
        self._peft: Any = None
        self.shapes: dict[str, AdapterShape] = {}

    @property
    def model(self) -> Any:
        """What to call: the peft wrapper while any adapter exists, else the bare base model."""
        return self._peft if self._peft is not None else self._base_model

    @property
    def vocab_size(self) -> int:
        return int(self._base_model.config.vocab_size)

    @property
    def max_context(self) -> int:
        return int(self._base_model.config.max_position_embeddings)

    # -- adapters --------------------------------------------------------------------------------------------------
    def add(self, name: str, shape: AdapterShape, seed: int | None = None, config: Any = None) -> None:
        """A fresh adapter: A drawn from ``seed`` (None: from torch's RNG), B zero, so it starts as the base model.
        ``config``: a peft ``LoraConfig`` to use instead of ``shape``'s (an adapter read from disk keeps its own)."""
        from peft import get_peft_model

        from opentinker.agents.lora_rows import install

        install()  # mixed batches at the cost of one batch (agents/lora_rows.py)
        if name in self.shapes or name == BASE or "." in name:
            raise ValueError(f"adapter name {name!r} is taken or invalid")
        config = config or shape.peft_config()
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            if self._peft is None:
                self._peft = get_peft_model(self._base_model, config, adapter_name=name)
            else:
                self._peft.add_adapter(name, config)
        self._peft.eval()
        self.shapes[name] = shape
        self.activate(name)

    def copy(self, source: str, name: str) -> None:
        """A new adapter ``name`` holding ``source``'s tensors as they are now (a sampler's snapshot of a training
        adapter): its layers added without an initial draw and the tensors copied in place, not through a state
        dict (SmolLM2, rank 16: 0.23 s against 0.33 s for ``add`` then ``load_state``)."""
        import copy

        self._require(source)
        config = copy.deepcopy(self._peft.peft_config[source])
        config.init_lora_weights = False
        self.add(name, self.shapes[source], config=config)
        sources = {key.replace(f".{source}.", "."): param for key, param in self._named(source)}
        with torch.no_grad():
            for key, param in self._named(name):
                param.copy_(sources[key.replace(f".{name}.", ".")])

    def remove(self, name: str) -> None:
        """Drop the adapter and its tensors; the last one unwraps the base model."""
        if name not in self.shapes:
            return
        del self.shapes[name]
        if not self.shapes:
            self._base_model = self._peft.unload()
            self._peft = None
            return
        if self._peft.active_adapter == name:
            self._peft.set_adapter(next(iter(self.shapes)))
        self._peft.delete_adapter(name)

    def activate(self, name: str) -> None:
        """Make ``name`` the adapter forward passes use and the only one whose tensors take gradients."""
        self._require(name)
        self._peft.set_adapter(name)

    def parameters(self, name: str) -> list[torch.nn.Parameter]:
        """The adapter's tensors in a fixed (name-sorted) order: optimiser state lines up across save and load."""
        self._require(name)
        return [p for _, p in self._named(name)]

    def _named(self, name: str) -> list[tuple[str, torch.nn.Parameter]]:
        marker = f".{name}."
        return sorted((n, p) for n, p in self._peft.named_parameters() if "lora_" in n and marker in n)

    def state(self, name: str) -> dict[str, torch.Tensor]:
        """The adapter's tensors (peft's key names, adapter name stripped), cloned to the CPU."""
        from peft import get_peft_model_state_dict

        self._require(name)
        state = get_peft_model_state_dict(self._peft, adapter_name=name, save_embedding_layers=False)
        return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    def load_state(self, name: str, state: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        self._require(name)
        result = set_peft_model_state_dict(self._peft, state, adapter_name=name)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"adapter state: unexpected keys {unexpected[:3]}")

    def save(self, name: str, directory: str | Path, **meta: Any) -> Path:
        """peft's adapter files, the tokenizer and ``opentinker_llm.json``: loadable by ``PeftModel.from_pretrained``,
        ``load`` and the registry (``tracking.llm_store``)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(self.state(name), str(directory / "adapter_model.safetensors"))
        self._peft.peft_config[name].save_pretrained(str(directory))
        self.tokenizer.save_pretrained(str(directory))
        (directory / ADAPTER_META).write_text(json.dumps({"base_model": self.base, **meta}, indent=2))
        return directory

    def load(self, name: str, directory: str | Path) -> AdapterShape:
        """An adapter saved by ``save`` (or any peft LoRA folder for this base) added under ``name``."""
        from peft import PeftConfig
        from safetensors.torch import load_file

        directory = Path(directory)
        config = PeftConfig.from_pretrained(str(directory))
        targets = set(config.target_modules)
        shape = AdapterShape(
            rank=int(config.r),
            train_attn=bool(targets & set(ATTENTION)),
            train_mlp=bool(targets & set(MLP)),
            train_unembed=bool(targets & set(UNEMBED)),
            alpha=int(config.lora_alpha),
        )
        config.inference_mode = False
        self.add(name, shape, seed=0, config=config)
        self.load_state(name, load_file(str(directory / "adapter_model.safetensors")))
        return shape

    def _require(self, name: str) -> None:
        if name not in self.shapes:
            raise KeyError(f"no adapter {name!r} on base model {self.base!r}")

    # -- forward passes --------------------------------------------------------------------------------------------
    def target_logprobs(
        self,
        name: str | Sequence[str] | None,
        inputs: Sequence[Sequence[int]],
        targets: Sequence[torch.Tensor],
        active: Sequence[torch.Tensor | None] | None = None,
        offsets: Sequence[int] | None = None,
    ) -> list[torch.Tensor]:
        """log p(targets[i][t] | inputs[i][: offsets[i] + t + 1]) for a batch (right-padded, one pass of the
        decoder), with the graph when gradients are enabled. ``targets[i]`` is (T_i,) or (T_i, K); the result has its
        shape. ``name`` None: the base model alone; a list: each row's adapter (several clients' rows in one pass,
        peft's mixed batch; each adapter's tensors get the gradient of its own rows only).

        ``active[i]``: a (T_i,) mask of the positions whose log-probabilities need a gradient (None: all). The
        output projection, a vocabulary-wide matmul per position, runs with the graph only there and under no_grad
        elsewhere: a prompt's positions cost their forward, not their backward and their activations.

        ``offsets[i]``: the position of ``targets[i][0]``'s prediction (None: 0), so that positions before it (a
        prompt whose log-probabilities nobody asks for, as in GRPO) skip the output projection altogether."""
        width = max(len(x) for x in inputs)
        ids = torch.zeros((len(inputs), width), dtype=torch.long)
        attention = torch.zeros((len(inputs), width), dtype=torch.long)
        for row, tokens in enumerate(inputs):
            ids[row, : len(tokens)] = torch.as_tensor(list(tokens), dtype=torch.long)
            attention[row, : len(tokens)] = 1
        ids, attention = ids.to(self.device), attention.to(self.device)
        names = None if name is None or isinstance(name, str) else list(name)
        if names is not None and len(set(names)) == 1:
            name, names = names[0], None
        offsets = offsets or [0] * len(inputs)
        if names is not None:
            return self._mixed_logprobs(names, ids, attention, targets, active, offsets)
        with self.using(name):
            causal_lm = self._peft.get_base_model() if self._peft is not None else self._base_model
            hidden = causal_lm.get_decoder()(input_ids=ids, attention_mask=attention).last_hidden_state
            head = causal_lm.get_output_embeddings()
            out = []
            for row, (target, start) in enumerate(zip(targets, offsets)):
                mask = None if active is None else active[row]
                rows = hidden[row, start : start + target.shape[0]]
                out.append(_head_logprobs(head, rows, target.to(self.device), mask))
        return out

    def _mixed_logprobs(
        self,
        names: list[str],
        ids: torch.Tensor,
        attention: torch.Tensor,
        targets: Sequence[torch.Tensor],
        active: Sequence[torch.Tensor | None] | None,
        offsets: Sequence[int],
    ) -> list[torch.Tensor]:
        """``target_logprobs`` with an adapter per row: the decoder runs once with peft's ``adapter_names`` (the
        model stays in eval mode, as always here: no dropout), the output projection per row with its adapter."""
        for adapter in set(names):
            self._require(adapter)
            for param in self.parameters(adapter):  # set_adapter leaves only the active adapter trainable
                param.requires_grad_(True)
        causal_lm = self._peft.get_base_model()
        with self._peft._enable_peft_forward_hooks(adapter_names=names):
            hidden = causal_lm.get_decoder()(input_ids=ids, attention_mask=attention).last_hidden_state
        head = causal_lm.get_output_embeddings()
        lora_head = hasattr(head, "lora_A")
        out = []
        for row, (target, start) in enumerate(zip(targets, offsets)):
            mask = None if active is None else active[row]
            adapter = names[row]

            def row_head(h: torch.Tensor, adapter: str = adapter) -> torch.Tensor:
                return head(h, adapter_names=[adapter] * h.shape[0]) if lora_head else head(h)

            rows = hidden[row, start : start + target.shape[0]]
            out.append(_head_logprobs(row_head, rows, target.to(self.device), mask))
        return out

    def using(self, name: str | None) -> Any:
        """A context in which forward passes use adapter ``name`` (None: the base model alone)."""
        if name is None:
            return self._peft.disable_adapter() if self._peft is not None else contextlib.nullcontext()
        self.activate(name)
        return contextlib.nullcontext()


HEAD_CHUNK = 1024
"""Positions per no-grad pass of the output projection (bounds the (positions x vocabulary) logits in memory)."""


def _head_logprobs(head: Any, hidden: torch.Tensor, target: torch.Tensor, active: torch.Tensor | None) -> torch.Tensor:
    """log-softmax of ``head(hidden)`` at ``target``, with the graph at the ``active`` positions only."""

    def pick(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logits = head(h).float()
        index = t.view(t.shape[0], -1)
        return (logits.gather(-1, index) - torch.logsumexp(logits, dim=-1, keepdim=True)).view(t.shape)

    if active is None or not torch.is_grad_enabled():
        if torch.is_grad_enabled():
            return pick(hidden, target)
        return torch.cat(
            [pick(hidden[i : i + HEAD_CHUNK], target[i : i + HEAD_CHUNK]) for i in range(0, len(target), HEAD_CHUNK)]
        )
    active = active.to(hidden.device)
    out = torch.zeros(target.shape, dtype=torch.float32, device=hidden.device)
    with torch.no_grad():
        idle = (~active).nonzero().squeeze(1)
        for i in range(0, len(idle), HEAD_CHUNK):
            chunk = idle[i : i + HEAD_CHUNK]
            out[chunk] = pick(hidden[chunk], target[chunk])
    if active.any():
        out = out.index_put((active.nonzero().squeeze(1),), pick(hidden[active], target[active]))
    return out
