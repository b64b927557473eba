"""Policies in the MLflow model registry: the one place that knows OpenTinker's MLflow model format.

Format: an MLflow pyfunc model whose data is the RL core's export directory
(``agents.export.export_policy``: ``policy.json`` + ``weights.npz``), loaded through this module as
its loader module (no pickled code), with a tensor signature derived from the policy's spaces and
the export's spec as model metadata. Any MLflow client can ``mlflow.pyfunc.load_model(uri).predict(obs_batch)``;
OpenTinker itself skips pyfunc and loads the export directory straight into the numpy ``InferencePolicy``.

Typical package stage::

    model_uri = log_policy_model(export_dir, run_id=run_id)
    version = register_policy(model_uri, "cartpole").version
    set_alias("cartpole", "champion", version)
    policy = load_registered_policy("models:/cartpole@champion")
"""

from __future__ import annotations

import hashlib
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, Field

from opentinker.tracking.runs import configure_mlflow, ensure_experiment

if TYPE_CHECKING:
    from opentinker.agents.export import InferencePolicy

POLICY_FILE = "policy.json"
_LOGGED_MODEL_ID = re.compile(r"^m-[0-9a-f]{32}$")
_MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>[^/]+))?/?$")


class ModelRef(BaseModel):
    """A model in the registry (or a local export) pinned to one version: what every stage and service passes on.

    ``resolve_policy`` is the one place that makes one from a URI; registration fills in where its aliases point.
    """

    uri: str = ""
    """The URI as given (``models:/NAME@alias``, ``models:/NAME/3``, ``runs:/...`` or a local directory)."""
    name: str
    """Registered model name; the directory name for a local export."""
    version: str
    """Registered version; for a local export ``local-<weights hash>``; for other URIs the MLflow model id."""
    run_id: str | None = None
    """MLflow run that logged the model, when known."""
    alias: str | None = None
    """The alias the URI named, if any."""
    download_uri: str = ""
    """A URI that pins this exact version (never an alias), or the local directory."""
    aliases: list[str] = []
    """Every alias pointing at this version (after registration or the promotion gate, when known)."""
    decision: str = ""
    """The promotion gate's decision, once it ran."""
    model_id: str = Field("", description="MLflow 3 logged-model id (``m-…``): metrics linked to it show on its page.")

    @property
    def key(self) -> str:
        """``name/version``: names an immutable model (evaluation cache keys, reports)."""
        return f"{self.name}/{self.version}"

    @property
    def in_registry(self) -> bool:
        """Pinned to an MLflow store (versions are numbered per store), not a local directory."""
        return self.download_uri.startswith(("models:/", "runs:/"))


def slug(text: str) -> str:
    """Lower-case ASCII letters and digits, every other run of characters one ``-``: safe in registered model names,
    run names and BentoML tags and labels (``ALE/Pong-v5`` → ``ale-pong-v5``)."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


class PolicyStoreError(RuntimeError):
    """A model URI that cannot be resolved or does not hold an OpenTinker policy."""


def _client():
    return configure_mlflow().MlflowClient()


def _load_export(directory: str | Path) -> InferencePolicy:
    from opentinker.agents.export import load_policy

    return load_policy(Path(directory))


def _parts(space) -> list[tuple[str | None, Any]]:
    """(name, leaf space) pairs: a Dict/Tuple observation is one named tensor per part (tuple parts "0", "1", ...)."""
    from gymnasium import spaces

    if isinstance(space, spaces.Dict):
        return list(space.spaces.items())
    if isinstance(space, spaces.Tuple):
        return [(str(i), sub) for i, sub in enumerate(space.spaces)]
    return [(None, space)]


def _tensor_spec(space, name: str | None = None) -> Any:
    from gymnasium import spaces
    from mlflow.types.schema import TensorSpec

    if isinstance(space, spaces.Discrete):
        return TensorSpec(np.dtype(np.int64), (-1,), name)
    if isinstance(space, (spaces.Box, spaces.MultiDiscrete, spaces.MultiBinary)):
        return TensorSpec(np.dtype(space.dtype), (-1, *space.shape), name)
    raise PolicyStoreError(
        f"space: expected Box, Discrete, MultiDiscrete, MultiBinary or a Dict/Tuple of them; got {type(space).__name__}"
    )


def _policy_signature(policy: InferencePolicy):
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Schema

    return ModelSignature(
        inputs=Schema([_tensor_spec(sub, name) for name, sub in _parts(policy.observation_space)]),
        outputs=Schema([_tensor_spec(policy.action_space)]),
    )


def _input_example(policy: InferencePolicy) -> np.ndarray | dict[str, np.ndarray]:
    """One observation drawn (seeded) from the policy's space: shown in the MLflow UI next to the signature."""
    space = policy.observation_space
    space.seed(0)
    sample = space.sample()
    parts = _parts(space)
    if parts[0][0] is None:
        return np.asarray([sample], dtype=space.dtype)
    leaves = sample.values() if isinstance(sample, dict) else sample
    return {name: np.asarray([leaf], dtype=sub.dtype) for (name, sub), leaf in zip(parts, leaves)}


def _pip_requirements() -> list[str]:
    from importlib.metadata import version

    return [f"{pkg}=={version(pkg)}" for pkg in ("numpy", "gymnasium", "opentinker")]


def _jsonable(value: Any) -> Any:
    """MLflow metadata must be YAML-serialisable: numpy scalars/arrays become plain lists/numbers."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


class _PolicyPyfunc:
    """``mlflow.pyfunc`` face of an exported policy: ``predict(obs_batch) -> actions``."""

    def __init__(self, policy: InferencePolicy):
        self.policy = policy

    def predict(self, model_input, params=None):
        from gymnasium import spaces

        if isinstance(model_input, dict) and isinstance(self.policy.observation_space, spaces.Tuple):
            model_input = tuple(model_input[str(i)] for i in range(len(model_input)))
        return self.policy.act(model_input if isinstance(model_input, (dict, tuple)) else np.asarray(model_input))


def _load_pyfunc(data_path: str) -> _PolicyPyfunc:
    """MLflow's loader-module hook (``mlflow.pyfunc.load_model``): no pickled code in the model."""
    return _PolicyPyfunc(_load_export(data_path))


def log_policy_model(
    export_dir: str | Path,
    *,
    run_id: str | None = None,
    name: str = "policy",
    registered_model_name: str | None = None,
    metadata: dict[str, Any] | None = None,
    step: int = 0,
) -> str:
    """Log an export directory as an MLflow pyfunc model and return its model URI.

    Logs into ``run_id`` when given, else into the active run, else into a new run of the configured
    experiment. ``registered_model_name`` also registers it (the pipeline calls ``register_policy``).
    ``step`` is the env step the policy was trained to: MLflow links the run's metrics at that step to the model.
    """
    export_dir = Path(export_dir)
    if not (export_dir / POLICY_FILE).is_file():
        raise PolicyStoreError(
            f"export_dir: expected a directory with {POLICY_FILE} (agents.export.export_policy), got {export_dir}"
        )
    policy = _load_export(export_dir)
    import mlflow

    experiment_id = ensure_experiment()
    kwargs = dict(
        name=name,
        loader_module="opentinker.tracking.registry",
        data_path=str(export_dir),
        signature=_policy_signature(policy),
        input_example=_input_example(policy),
        registered_model_name=registered_model_name,
        pip_requirements=_pip_requirements(),
        metadata=_jsonable({"opentinker_policy": getattr(policy, "spec", {}), **(metadata or {})}),
        step=step,
    )
    active = mlflow.active_run()
    if active is not None and run_id in (None, active.info.run_id):
        return mlflow.pyfunc.log_model(**kwargs).model_uri
    if active is not None:
        raise PolicyStoreError(f"run_id: another run ({active.info.run_id}) is active; end it or omit run_id")
    if run_id:
        # start_run(run_id) refuses a run outside the process-wide active experiment (set_experiment elsewhere).
        mlflow.set_experiment(experiment_id=_client().get_run(run_id).info.experiment_id)
    with mlflow.start_run(run_id=run_id, experiment_id=None if run_id else experiment_id):
        return mlflow.pyfunc.log_model(**kwargs).model_uri


def register_policy(model_uri: str, name: str, *, alias: str | None = None, tags: dict[str, str] | None = None):
    """Register a logged policy (the URI ``log_policy_model`` returned) as a new version of ``name``.

    Returns MLflow's ``ModelVersion`` (``.version``, ``.run_id``); ``alias`` is then pointed at it.
    """
    model_version = configure_mlflow().register_model(model_uri, name, tags=tags)
    if alias:
        set_alias(name, alias, model_version.version)
    return model_version


def set_alias(name: str, alias: str, version: str | int) -> None:
    """Point ``models:/name@alias`` at ``version`` (a running service polls and follows it)."""
    _client().set_registered_model_alias(name, alias, str(version))


def resolve_policy(model_uri: str | Path) -> ModelRef:
    """Resolve a URI to the exact version it names now; local export directories are accepted too."""
    uri = str(model_uri)
    if uri.startswith("runs:/"):
        run_id = uri[len("runs:/") :].split("/", 1)[0]
        name = uri.rstrip("/").rsplit("/", 1)[-1]
        return ModelRef(uri=uri, name=name, version=run_id, run_id=run_id, download_uri=uri)
    if not uri.startswith("models:/"):
        return _resolve_local(Path(uri))
    match = _MODELS_URI.match(uri)
    if match is None:
        raise PolicyStoreError(f"model_uri: expected models:/NAME@ALIAS or models:/NAME/VERSION, got {uri!r}")
    name, alias, version = match["name"], match["alias"], match["version"]
    if _LOGGED_MODEL_ID.match(name) and not (alias or version):
        model = _client().get_logged_model(name)
        return ModelRef(uri=uri, name=model.name, version=name, run_id=model.source_run_id, download_uri=uri)
    from mlflow.exceptions import MlflowException

    client = _client()
    try:
        if alias:
            mv = client.get_model_version_by_alias(name, alias)
        elif version in (None, "latest"):
            versions = client.search_model_versions(f"name='{name}'")
            if not versions:
                raise PolicyStoreError(f"model_uri: registered model {name!r} has no versions")
            mv = max(versions, key=lambda v: int(v.version))
        else:
            mv = client.get_model_version(name, version)
    except MlflowException as exc:
        raise PolicyStoreError(f"model_uri: cannot resolve {uri!r}: {exc.message}") from exc
    return ModelRef(
        uri=uri,
        name=name,
        version=str(mv.version),
        run_id=mv.run_id,
        alias=alias,
        download_uri=f"models:/{name}/{mv.version}",
        aliases=list(mv.aliases or []),
        model_id=mv.model_id or "",
    )


def _resolve_local(directory: Path) -> ModelRef:
    if not (directory / POLICY_FILE).is_file():
        raise PolicyStoreError(
            f"model_uri: expected models:/NAME@ALIAS, models:/NAME/VERSION, runs:/... or an export directory "
            f"with {POLICY_FILE}, got {str(directory)!r}"
        )
    content = hashlib.sha256()
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        content.update(path.name.encode() + b"\0")
        with path.open("rb") as handle:  # in chunks: the export may be a job's, as large as its limits allow
            while chunk := handle.read(1 << 20):
                content.update(chunk)
    resolved = directory.resolve()
    version = f"local-{content.hexdigest()[:12]}"
    return ModelRef(uri=str(directory), name=resolved.name, version=version, download_uri=str(resolved))


def download_policy(ref: ModelRef, dst: str | Path | None = None) -> Path:
    """The export directory of exactly ``ref``'s version, downloaded when it is remote."""
    if not ref.download_uri.startswith(("models:/", "runs:/")):
        return Path(ref.download_uri)
    dst = Path(dst) if dst is not None else Path(tempfile.mkdtemp(prefix="opentinker-policy-"))
    model_dir = Path(configure_mlflow().artifacts.download_artifacts(artifact_uri=ref.download_uri, dst_path=str(dst)))
    found = sorted(model_dir.glob(f"**/{POLICY_FILE}"))
    if not found:
        raise PolicyStoreError(
            f"model_uri: {ref.uri!r} is not an OpenTinker policy (no {POLICY_FILE} in its artifacts)"
        )
    return found[0].parent


def load_policy_version(model_uri: str | Path) -> tuple[ModelRef, InferencePolicy]:
    """Resolve then load, so the returned policy is exactly the version named in the ref."""
    ref = resolve_policy(model_uri)
    return ref, _load_export(download_policy(ref))


def load_registered_policy(model_uri: str | Path) -> InferencePolicy:
    """The numpy ``InferencePolicy`` behind a registry URI, a run URI or a local export directory."""
    return load_policy_version(model_uri)[1]
