"""One dependency direction: ``lint-imports`` (import-linter) keeps the contracts of pyproject.toml
(``[tool.importlinter]``), lazy imports inside functions included: no package imports a layer above it, and inside
a package no two modules need each other (no import cycle).

The package's subpackages live in the repository's top-level folders (setuptools ``package-dir``), which grimp cannot
follow from the editable install, so the check runs on a copy laid out as the installed package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


@pytest.fixture(scope="module")
def package_tree(tmp_path_factory) -> Path:
    """``opentinker`` as one folder, each subpackage copied from its ``package-dir`` folder."""
    dest = tmp_path_factory.mktemp("layers")
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in package_dirs.items():
        target = dest.joinpath(*package.split("."))
        shutil.copytree(ROOT / folder, target, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    return dest


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo", "--config", str(ROOT / "pyproject.toml")],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_no_package_imports_a_layer_above_it(package_tree):
    result = lint_imports(package_tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 3 kept, 0 broken." in result.stdout


def test_a_lazy_upward_import_breaks_the_contract(package_tree, tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(package_tree, tree)
    (tree / "opentinker" / "envs" / "upward.py").write_text(
        "def trainer():\n    from opentinker.agents import trainer\n\n    return trainer\n"
    )
    result = lint_imports(tree)
    assert result.returncode == 1
    assert "opentinker.envs.upward -> opentinker.agents.trainer" in result.stdout


def test_a_lazy_import_cycle_inside_a_package_breaks_the_contract(package_tree, tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(package_tree, tree)
    serving = tree / "opentinker" / "serving"
    (serving / "slot_a.py").write_text("from opentinker.serving import slot_b\n")
    (serving / "slot_b.py").write_text("def back():\n    from opentinker.serving import slot_a\n\n    return slot_a\n")
    result = lint_imports(tree)
    assert result.returncode == 1
    assert "no import cycles inside a package BROKEN" in result.stdout, result.stdout
    assert "in opentinker.serving" in result.stdout and "- .slot_b -> .slot_a (1 import)" in result.stdout
