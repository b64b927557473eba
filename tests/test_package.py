"""The installable package: the wheel ``uv build --wheel`` makes holds every package and data file of the tree, its
metadata names what the code imports, and it works installed on its own, away from the checkout.

The editable install hides a package missing from the wheel (it imports from the checkout), so the wheel is built
from a copy of the working tree (no ``build/`` or egg-info left in the checkout), installed into a fresh venv that
sees the locked dependencies through a ``.pth`` file, and imported from a folder outside the checkout.
"""

from __future__ import annotations

import ast
import email
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import opentinker

ROOT = Path(__file__).resolve().parents[1]
UV = Path(sys.executable).with_name("uv")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]

# Optional parts: the files (wheel paths; a folder ends in "/") whose imports may come from an extra.
OPTIONAL_PARTS = {
    "opentinker/server/": "server",
    "opentinker/cli/server.py": "server",
    "opentinker/federated/": "federated",
    "opentinker/envs/atari.py": "atari",
    "opentinker/envs/mujoco_log.py": "mujoco",
}


def _source_files() -> list[str]:
    """The working tree's files, as a clean clone with the uncommitted changes would have them (git's view)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [name for name in listed.split("\0") if name and (ROOT / name).is_file()]


def _build_outputs() -> dict[str, float]:
    """What a build run in the checkout would leave there: build/, dist/, *.egg-info (with their mtimes)."""
    found = {}
    for top in [ROOT / "build", ROOT / "dist", *ROOT.glob("*.egg-info")]:
        for path in [top, *top.rglob("*")] if top.exists() else []:
            found[str(path)] = path.stat().st_mtime
    return found


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, list[str]]:
    """(the wheel built from a copy of the working tree, the copied files)."""
    tmp = tmp_path_factory.mktemp("package")
    source = tmp / "source"
    files = _source_files()
    for name in files:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    before = _build_outputs()
    # No build isolation: the venv's setuptools builds it, offline.
    done = subprocess.run(
        [
            str(UV),
            "build",
            "--wheel",
            "--no-build-isolation",
            "--python",
            sys.executable,
            "--out-dir",
            str(tmp / "dist"),
        ],
        cwd=source,
        env={**os.environ, "UV_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _build_outputs() == before, "building the wheel changed build outputs in the checkout"
    (wheel,) = (tmp / "dist").glob("opentinker-*.whl")
    return wheel, files


def _wheel_path(source_name: str) -> str | None:
    """Where a file of the tree lands in the wheel (package-dir mapping), or None when no package folder holds it."""
    best = None
    for package, folder in PACKAGE_DIRS.items():
        if source_name.startswith(folder + "/") and (best is None or len(folder) > len(best[1])):
            best = (package, folder)
    if best is None:
        return None
    package, folder = best
    return "/".join(package.split(".")) + source_name[len(folder) :]


def test_wheel_holds_every_package_and_data_file(built):
    wheel, files = built
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {name: _wheel_path(name) for name in files if _wheel_path(name) is not None}
    packages = {target.removesuffix("/__init__.py") for target in shipped.values() if target.endswith("/__init__.py")}
    assert "opentinker/server/tinker" in packages  # the one the hand-written list missed
    missing = sorted(f"{name} (as {target})" for name, target in shipped.items() if target not in names)
    assert not missing, f"files of the package folders missing from {wheel.name}: {missing}"
    assert any(name.startswith("opentinker/infra/k8s/") and name.endswith(".yaml") for name in names)
    wheel_packages = {name.removesuffix("/__init__.py") for name in names if name.endswith("/__init__.py")}
    assert wheel_packages == packages
    dist_info = f"opentinker-{opentinker.__version__}.dist-info/"
    strays = sorted(name for name in names if not name.startswith(("opentinker/", dist_info)))
    assert not strays, f"files outside the package in {wheel.name}: {strays}"


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(archive.read(name))


def _locked() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[canonicalize_name(name.split("[")[0])] = version.split(";")[0].strip()
    return pins


def test_metadata_version_and_requirements_match_the_lock(built):
    metadata = _metadata(built[0])
    assert metadata["Version"] == opentinker.__version__ == PYPROJECT["project"]["version"]
    locked = _locked()
    wrong = []
    for line in metadata.get_all("Requires-Dist"):
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        if name == "opentinker":  # an extra naming others ("all")
            continue
        if name not in locked or not requirement.specifier.contains(locked[name], prereleases=True):
            wrong.append(f"{line} (lock: {locked.get(name, 'absent')})")
    assert not wrong, f"requirements the locked set (requirements.lock) does not satisfy: {wrong}"
    extras = set(metadata.get_all("Provides-Extra"))
    assert set(OPTIONAL_PARTS.values()) <= extras
    assert {"server", "tinker", "federated"} <= extras


def _imports(source: str) -> set[str]:
    """Top-level names of the absolute imports of a module, lazy ones inside functions included."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"opentinker", "__future__"}


def test_every_imported_distribution_is_declared(built):
    """A module imports only distributions the metadata names: the base list, or the extra of its optional part."""
    metadata = _metadata(built[0])
    declared: dict[str, set[str]] = {}  # extra ("" for the base) -> names
    for line in metadata.get_all("Requires-Dist"):
        requirement = Requirement(line)
        extra = ""
        if requirement.marker is not None:
            extra = next(e for e in metadata.get_all("Provides-Extra") if requirement.marker.evaluate({"extra": e}))
        declared.setdefault(extra, set()).add(canonicalize_name(requirement.name))
    providers = importlib.metadata.packages_distributions()
    undeclared = []
    with zipfile.ZipFile(built[0]) as archive:
        for name in archive.namelist():
            if not name.endswith(".py"):
                continue
            part = next((extra for prefix, extra in OPTIONAL_PARTS.items() if name.startswith(prefix)), None)
            allowed = declared[""] | declared.get(part, set())
            for module in sorted(_imports(archive.read(name).decode())):
                dists = {canonicalize_name(d) for d in providers.get(module, [])}
                if not dists & allowed:
                    undeclared.append(f"{name}: {module} (from {sorted(dists) or 'no installed distribution'})")
    assert not undeclared, (
        "imports of distributions pyproject.toml does not name (add them to [project] dependencies, or to the extra "
        f"of the optional part, OPTIONAL_PARTS here): {undeclared}"
    )


def test_installed_wheel_imports_and_runs_outside_the_checkout(built, tmp_path):
    wheel = built[0]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # The locked dependencies from this venv, after the new venv's own site-packages. The .pth files in there (the
    # editable install of the checkout among them) are not processed: the checkout stays out of sys.path.
    (site / "locked_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(UV_OFFLINE="1", PYTHONNOUSERSITE="1")
    done = subprocess.run(
        [str(UV), "pip", "install", "--python", str(python), "--no-deps", "--no-index", "-q", str(wheel)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    with zipfile.ZipFile(wheel) as archive:
        packages = sorted(
            n.removesuffix("/__init__.py").replace("/", ".") for n in archive.namelist() if n.endswith("/__init__.py")
        )
    script = (
        "import importlib, importlib.resources, json, sys\n"
        f"names = {packages!r} + ['opentinker.server.app', 'opentinker.server.tinker.engine']\n"
        "files = {name: importlib.import_module(name).__file__ for name in names}\n"
        "k8s = importlib.resources.files('opentinker.infra') / 'k8s' / 'kustomization.yaml'\n"
        "print(json.dumps({'files': files, 'k8s': k8s.is_file(), 'path': sys.path}))\n"
    )
    done = subprocess.run(
        [str(python), "-c", script], cwd=outside, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert str(ROOT) not in report["path"]
    elsewhere = {name: file for name, file in report["files"].items() if not Path(file).is_relative_to(site)}
    assert not elsewhere, f"modules imported from outside the installed wheel ({site}): {elsewhere}"
    assert report["k8s"], "the k8s manifests are not in the installed package"

    version = subprocess.run(
        [str(venv / "bin" / "opentinker"), "--version"],
        cwd=outside,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert version.returncode == 0, version.stdout + version.stderr
    assert version.stdout.strip() == f"opentinker {opentinker.__version__}"
