"""The tree stays ruff-clean (``[tool.ruff]`` in pyproject.toml), so ``.ci/run`` fails on a lint or format error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--config", str(ROOT / "pyproject.toml")],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]])
def test_tree_is_ruff_clean(command):
    result = ruff(*command)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_long_line_fails_the_check(tmp_path):
    (tmp_path / "long.py").write_text(f"NAME = {'x' * 130!r}\n")
    result = ruff("check", ".", cwd=tmp_path)
    assert result.returncode == 1
    assert "E501" in result.stdout
