"""Package the policy service as a Bento (``bentoml build``), offline, with the project code as a wheel.

Two flavours:
- bundled (default): the resolved policy version is saved as a BentoML model inside the Bento and
  served from there (``OPENTINKER_SERVE_MODEL=bentoml:TAG``): an immutable image, no registry needed.
- ``bundle=False``: the Bento serves the registry URI and follows its alias (the container then
  needs ``OPENTINKER_MLFLOW_TRACKING_URI``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib.metadata import version as installed_version
from pathlib import Path
from typing import Any

from opentinker.tracking.registry import slug

from .deploy import SERVICE_IMPORT
from .model_slot import BUNDLED_PREFIX

BENTO_NAME = "opentinker_policy"
RUNTIME_PACKAGES = ("bentoml", "mlflow", "numpy", "gymnasium", "pydantic", "pydantic-settings", "psutil")


@dataclass(frozen=True)
class PackageResult:
    tag: str
    """The Bento's tag (``opentinker_policy:VERSION``) in the local Bento store."""
    path: Path
    """Where the built Bento lies (``$BENTOML_HOME/bentos/...``)."""
    serves: str
    """The model URI the Bento serves (``bentoml:...`` when bundled)."""
    policy_version: str


def _save_bundled_policy(model_ref: str):
    import bentoml

    from opentinker.tracking.registry import download_policy, resolve_policy

    ref = resolve_policy(model_ref)
    export_dir = download_policy(ref)
    metadata = {"name": ref.name, "version": ref.version, "run_id": ref.run_id or "", "source_uri": str(model_ref)}
    with bentoml.models.create(
        f"opentinker-policy-{slug(ref.name) or 'policy'}", metadata=metadata, labels={"source": "opentinker"}
    ) as model:
        for item in export_dir.iterdir():
            if item.is_file():
                shutil.copy2(item, Path(model.path) / item.name)
    return model, ref


def _project_root() -> Path:
    root = Path(__file__).resolve().parents[1]
    if not (root / "pyproject.toml").is_file():
        raise RuntimeError(f"packaging needs the OpenTinker source checkout (pyproject.toml not found in {root})")
    return root


def build_project_wheel(directory: Path) -> Path:
    """``pip wheel`` a copy of the project (no deps, no build isolation, no index): offline, and the
    checkout gets no ``build/`` or egg-info side effects."""
    import tomllib

    root = _project_root()
    package_dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    source = directory / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for folder in sorted(set(package_dirs.values())):
        shutil.copytree(root / folder, source / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(root / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(directory),
            str(source),
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=directory,
    )
    shutil.rmtree(source)
    return next(directory.glob("opentinker-*.whl"))


def bentofile(serves: str, wheel: Path, models: list[str], labels: dict[str, str]) -> dict[str, Any]:
    """The build config: the service, runtime pins plus the project wheel (relative to the build context), the model."""
    return {
        "service": SERVICE_IMPORT,
        "name": BENTO_NAME,
        "labels": labels,
        "include": ["bentofile.yaml"],
        "python": {
            "packages": [f"{pkg}=={installed_version(pkg)}" for pkg in RUNTIME_PACKAGES],
            "wheels": [wheel.as_posix()],
            "lock_packages": False,
        },
        "envs": [{"name": "OPENTINKER_SERVE_MODEL", "value": serves}],
        "models": models,
        "docker": {"python_version": "3.11"},
    }


def package_policy(model_ref: str, *, bundle: bool = True) -> PackageResult:
    """Build a Bento serving ``model_ref`` (needs no network: no lock step, the project as a local wheel)."""
    import bentoml
    import yaml

    with tempfile.TemporaryDirectory(prefix="opentinker-bento-") as tmp:
        staging = Path(tmp)
        wheel = build_project_wheel(staging / "wheels")
        if bundle:
            model, ref = _save_bundled_policy(model_ref)
            serves, models = f"{BUNDLED_PREFIX}{model.tag}", [str(model.tag)]
        else:
            from opentinker.tracking.registry import resolve_policy

            ref, serves, models = resolve_policy(model_ref), str(model_ref), []
        labels = {"model_name": slug(ref.name) or "policy", "model_version": slug(ref.version)}
        config = bentofile(serves, wheel.relative_to(staging), models, labels)
        (staging / "bentofile.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        tag = run_bentoml_build(staging)
    return PackageResult(tag, Path(bentoml.bentos.get(tag).path), serves, ref.version)


def run_bentoml_build(build_ctx: Path) -> str:
    """``bentoml build -o tag`` in ``build_ctx`` (BentoML resolves build paths from the working directory)."""
    from .deploy import server_env

    env = {k: v for k, v in server_env("", "").items() if not k.startswith("OPENTINKER_SERVE_")}
    done = subprocess.run(
        [sys.executable, "-m", "bentoml", "build", "-f", "bentofile.yaml", "-o", "tag", "."],
        cwd=build_ctx,
        env=env,
        capture_output=True,
        text=True,
    )
    tags = [line.split("__tag__:", 1)[1].strip() for line in done.stdout.splitlines() if "__tag__:" in line]
    if done.returncode != 0 or not tags:
        raise RuntimeError(f"bentoml build failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return tags[-1]
