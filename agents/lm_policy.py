"""The language models' base weights and the adapter folders they are saved as (the LoRA model itself, with its
adapters, is ``agents.multi_lora.MultiLoraModel``).

Base models: ``"smollm2"`` (the bundled SmolLM2-135M-Instruct, read from its GGUF by transformers and cached as a
plain checkpoint), ``"tiny"`` (a randomly initialised 2-layer Llama with SmolLM2's tokenizer, built in code from a
fixed seed: every process builds the same weights — tests use it), or a transformers checkpoint folder.
Only the adapter is trained, saved, shipped to rollout workers and registered; the base is rebuilt from its name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

BASE_MODELS = ("smollm2", "tiny")
ADAPTER_META = "opentinker_llm.json"
"""Written next to the peft adapter files: which base model the adapter belongs to."""
TINY_SEED = 1234
INIT_RANGE = 0.5
"""Wide initial weights give the tiny model a peaked next-token distribution, as a trained LM has, so sampling
explores a few tokens per context and a reward can move it within seconds (near-uniform over 49k tokens, it cannot)."""


def load_tokenizer(cache_dir: str | Path | None = None) -> Any:
    """SmolLM2's tokenizer (shared by every base model here)."""
    from transformers import AutoTokenizer

    from .lm_weights import bundled_gguf_path, converted_checkpoint

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gguf = bundled_gguf_path()
    folder = converted_checkpoint(gguf, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    return tokenizer


def load_base_model(base: str, cache_dir: str | Path | None = None, tokenizer: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer) for a base model name (see the module docstring), fp32, in eval mode."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from .lm_weights import converted_checkpoint

    tokenizer = tokenizer or load_tokenizer(cache_dir)
    if base == "smollm2":
        model = AutoModelForCausalLM.from_pretrained(converted_checkpoint(None, cache_dir), dtype=torch.float32)
    elif base == "tiny":
        config = base_config(base, tokenizer, cache_dir)
        with torch.random.fork_rng():
            torch.manual_seed(TINY_SEED)
            model = LlamaForCausalLM(config)
    elif Path(base).is_dir():
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    else:
        raise ValueError(f"base_model: expected one of {BASE_MODELS} or a transformers checkpoint folder, got {base!r}")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    return model, tokenizer


def base_config(base: str, tokenizer: Any, cache_dir: str | Path | None = None) -> Any:
    """The transformers config of a base model (its architecture; the tiny model's is built here)."""
    from transformers import AutoConfig, LlamaConfig

    from .lm_weights import converted_checkpoint

    if base == "smollm2":
        return AutoConfig.from_pretrained(converted_checkpoint(None, cache_dir))
    if base == "tiny":
        return LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            initializer_range=INIT_RANGE,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    if Path(base).is_dir():
        return AutoConfig.from_pretrained(base)
    raise ValueError(f"base_model: expected one of {BASE_MODELS} or a transformers checkpoint folder, got {base!r}")


def adapter_meta(directory: str | Path) -> dict:
    """An adapter folder's ``opentinker_llm.json`` (its base model, and its task when GRPO trained it)."""
    meta_path = Path(directory) / ADAPTER_META
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"{directory}: expected an adapter folder with {ADAPTER_META} (agents.multi_lora.MultiLoraModel.save)"
        )
    return json.loads(meta_path.read_text())


def load_adapted_model(
    directory: str | Path, cache_dir: str | Path | None = None, merge: bool = True
) -> tuple[Any, Any, dict]:
    """(model, tokenizer, meta) for a saved adapter: its base model rebuilt, the adapter loaded (and merged)."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    directory = Path(directory)
    meta = adapter_meta(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.padding_side = "left"
    base, tokenizer = load_base_model(meta["base_model"], cache_dir, tokenizer)
    config = json.loads((directory / "adapter_config.json").read_text())
    if "lm_head" in (config.get("target_modules") or ()) and base.config.tie_word_embeddings:
        untie_lm_head(base)
    model = PeftModel.from_pretrained(base, directory)
    model = model.merge_and_unload() if merge else model
    model.eval()
    return model, tokenizer, meta


def untie_lm_head(model: Any) -> None:
    """Give the output layer its own copy of the tied input embeddings: an adapter on ``lm_head`` changes the output
    projection only, and merging it into a tied weight would change the embeddings too."""
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.config.tie_word_embeddings = False
