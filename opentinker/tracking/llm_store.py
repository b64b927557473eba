"""LoRA adapters in the MLflow model registry: logged as a pyfunc model whose data is the adapter folder (peft's
files + ``opentinker_llm.json`` naming the base model), loaded through this module (no pickled code).

``mlflow.pyfunc.load_model(uri).predict(["What is 2 + 3?"])`` answers with the base + adapter, greedily; OpenTinker's
chat model downloads the folder (``download_adapter``) and serves it (``opentinker.llm.local_model.AdapterChatModel``).
URIs resolve like policies' (``tracking.registry.resolve_policy``): ``models:/NAME@champion`` names one version.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any

from opentinker.tracking.registry import ModelRef, PolicyStoreError, resolve_policy
from opentinker.tracking.runs import configure_mlflow, mlflow_at


def log_adapter_model(
    adapter_dir: str | Path, run_id: str, registered_name: str, tags: dict[str, str], tracking_uri: str | None = None
) -> str:
    """Log the adapter folder into ``run_id`` and register it as a new version of ``registered_name``.

    ``tracking_uri``: a store other than the configured one (the server registers into each tenant's, whose
    experiment says where artifacts go: no S3 credential is taken from this process's settings); MLflow's fluent API
    is process-wide, so the caller serialises such calls."""
    from opentinker.agents.lm_policy import ADAPTER_META

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / ADAPTER_META).is_file():
        raise PolicyStoreError(f"adapter_dir: expected a folder with {ADAPTER_META}, got {adapter_dir}")
    with mlflow_at(tracking_uri) if tracking_uri else contextlib.nullcontext(configure_mlflow()) as mlflow:
        client = mlflow.MlflowClient()
        mlflow.set_experiment(experiment_id=client.get_run(run_id).info.experiment_id)
        with mlflow.start_run(run_id=run_id):
            info = mlflow.pyfunc.log_model(
                name="adapter",
                loader_module="opentinker.tracking.llm_store",
                data_path=str(adapter_dir),
                metadata={"opentinker_llm": tags},
                pip_requirements=_requirements(),
            )
        version = mlflow.register_model(info.model_uri, registered_name, tags=tags)
    return str(version.version)


def _requirements() -> list[str]:
    """What loading an adapter needs, pinned to this environment's versions (MLflow's inference of them runs the
    loader in a subprocess: ~12 s a registration)."""
    from importlib.metadata import version

    return [f"{name}=={version(name)}" for name in ("torch", "transformers", "peft", "safetensors", "tokenizers")]


def download_adapter(model_uri: str) -> tuple[ModelRef, Path]:
    """(the exact version a URI names now, its adapter folder); a local adapter folder is used as is."""
    from opentinker.agents.lm_policy import ADAPTER_META

    if not model_uri.startswith(("models:/", "runs:/")):
        folder = Path(model_uri)
        if not (folder / ADAPTER_META).is_file():
            raise PolicyStoreError(
                f"llm: expected models:/NAME@ALIAS or an adapter folder with {ADAPTER_META}, got {model_uri!r}"
            )
        return ModelRef(uri=model_uri, name=folder.name, version="local", download_uri=str(folder)), folder
    ref = resolve_policy(model_uri)
    dst = Path(tempfile.mkdtemp(prefix="opentinker-adapter-"))
    root = Path(configure_mlflow().artifacts.download_artifacts(artifact_uri=ref.download_uri, dst_path=str(dst)))
    found = sorted(root.glob(f"**/{ADAPTER_META}"))
    if not found:
        raise PolicyStoreError(f"llm: {model_uri!r} is not an OpenTinker LoRA adapter (no {ADAPTER_META})")
    return ref, found[0].parent


class _AdapterPyfunc:
    """``predict(list of prompts) -> list of replies`` (greedy, the chat template, no tools)."""

    def __init__(self, folder: str):
        from opentinker.agents.lm_rollout import adapter_sampler

        self.sampler, self.meta = adapter_sampler(folder)
        self.tokenizer = self.sampler.model.tokenizer

    def predict(self, model_input: Any, params: dict | None = None) -> list[str]:
        from opentinker.agents.lm_rollout import POLICY, sample_turn

        prompts = [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": str(p)}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
            for p in list(model_input)
        ]
        out = sample_turn(self.sampler, POLICY, prompts, int(self.meta.get("max_new_tokens", 64)), 0.0, None)
        return [self.tokenizer.decode(c, skip_special_tokens=True).strip() for c in out]


def _load_pyfunc(data_path: str) -> _AdapterPyfunc:
    """MLflow's loader-module hook."""
    return _AdapterPyfunc(data_path)
