"""The Tinker cookbook's recipes, unmodified, against a real OpenTinker server on the tiny model.

The cookbook is not a dependency: ``tinker-cookbook`` 0.5.8, the newest the package index installs (0.6.1 needs a
``tml-renderers`` the index lacks), requires ``transformers<=5.5.4`` and the lock holds 5.24.0, so it cannot join the
locked set without changing a pin. Installed beside the venv (``tests/requirements-cookbook.txt`` says how) and named
by ``TINKER_COOKBOOK_PATH``, it runs here as a user would run it (its module, its flags, offline: the tokenizer comes
from ``opentinker tinker pull-tokenizer``); without it, these tests skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tinker
from fixtures.tinker import TINY

pytestmark = pytest.mark.slow

COOKBOOK = os.environ.get("TINKER_COOKBOOK_PATH", "")


def _cookbook_env(tinker_server, tenant: str, home: Path) -> dict[str, str]:
    """A client machine without the hub: the tenant's key, a fresh HF_HOME holding the pulled tokenizer."""
    env = {
        **os.environ,
        "TINKER_BASE_URL": tinker_server.url,
        "TINKER_API_KEY": tinker_server.key(tenant),
        "HF_HOME": str(home / "hf"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (COOKBOOK, os.environ.get("PYTHONPATH", "")) if p),
        "WANDB_MODE": "disabled",
    }
    env.pop("HF_HUB_CACHE", None)
    return env


def _has_cookbook() -> bool:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (COOKBOOK, os.environ.get("PYTHONPATH", "")) if p)}
    probe = [sys.executable, "-c", "import tinker_cookbook.recipes.math_rl.train"]
    return subprocess.run(probe, env=env, capture_output=True, timeout=300).returncode == 0


def test_math_rl_trains_and_resumes_with_its_renderer_from_the_run(request, tmp_path):
    """``math_rl`` on arithmetic with ``renderer_name=role_colon``, three steps and a checkpoint; then a second run
    from that checkpoint without ``renderer_name``, which the recipe reads back from the training run's
    ``user_metadata`` (the run outlived its session)."""
    if not _has_cookbook():
        pytest.skip("tinker_cookbook is not importable (set TINKER_COOKBOOK_PATH; see the module docstring)")
    tinker_server = request.getfixturevalue("tinker_server")  # started only when the recipe can run
    env = _cookbook_env(tinker_server, "cookbook", tmp_path)
    pull = [str(Path(sys.executable).with_name("opentinker")), "tinker", "pull-tokenizer", TINY]
    pulled = subprocess.run(pull, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    recipe = [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", f"model_name={TINY}", "env=arithmetic"]
    flags = [
        "lora_rank=4",
        "group_size=4",
        "groups_per_batch=2",
        "max_tokens=4",
        "learning_rate=1e-3",
        "eval_every=0",
        "save_every=2",
        f"base_url={tinker_server.url}",
        "behavior_if_log_dir_exists=delete",
    ]
    first = subprocess.run(
        [*recipe, *flags, "renderer_name=role_colon", "max_steps=3", f"log_path={tmp_path / 'first'}"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert first.returncode == 0, (first.stdout + first.stderr)[-5000:]
    metrics = [json.loads(line) for line in (tmp_path / "first" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3 and all("env/all/reward/total" in m for m in metrics), metrics[-1]
    saved = [json.loads(line) for line in (tmp_path / "first" / "checkpoints.jsonl").read_text().splitlines()]
    state = saved[-1]["state_path"]
    rest = tinker.RestClient(base_url=tinker_server.url, api_key=tinker_server.key("cookbook"))
    assert rest.get_training_run_by_tinker_path(state).result().user_metadata["renderer_name"] == "role_colon"

    second = subprocess.run(
        [*recipe, *flags, f"load_checkpoint_path={state}", "max_steps=1", f"log_path={tmp_path / 'second'}"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = second.stdout + second.stderr
    assert second.returncode == 0, output[-5000:]
    assert "Could not fetch renderer metadata" not in output
