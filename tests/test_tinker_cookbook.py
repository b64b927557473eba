"""The Tinker cookbook's recipes, unmodified, against a real OpenTinker server on the tiny model.

The cookbook is not a dependency: ``tinker-cookbook`` 0.5.8, the newest the package index installs (0.6.1 needs a
``tml-renderers`` the index lacks), requires ``transformers<=5.5.4`` and the lock holds 5.24.0, so it cannot join the
locked set without changing a pin. ``install.sh`` installs it beside the venv's packages (``.venv/tinker-cookbook``,
``tests/requirements-cookbook.txt``; ``TINKER_COOKBOOK_PATH`` names another folder), and it runs here as a user would
run it (its module, its flags, offline: the tokenizer comes from ``opentinker tinker pull-tokenizer``).
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

COOKBOOK = os.environ.get("TINKER_COOKBOOK_PATH") or str(Path(sys.prefix) / "tinker-cookbook")
"""Where the cookbook is installed: ``install.sh`` puts it in the venv's ``tinker-cookbook`` folder."""


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


def _cookbook_folder() -> Path | None:
    """The installed ``tinker_cookbook`` package's folder, or None when it is not importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (COOKBOOK, os.environ.get("PYTHONPATH", "")) if p)}
    code = "import os, tinker_cookbook.recipes.math_rl.train as t; print(os.path.dirname(t.__file__))"
    probe = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    return Path(probe.stdout.strip()).parents[1] if probe.returncode == 0 else None


@pytest.fixture
def cookbook(request, tmp_path):
    """(the cookbook's folder, the server, a client environment without the hub holding the pulled tokenizer)."""
    folder = _cookbook_folder()
    if folder is None:
        pytest.skip("tinker_cookbook is not importable (set TINKER_COOKBOOK_PATH; see the module docstring)")
    tinker_server = request.getfixturevalue("tinker_server")  # started only when a recipe can run
    env = _cookbook_env(tinker_server, "cookbook", tmp_path)
    pull = [str(Path(sys.executable).with_name("opentinker")), "tinker", "pull-tokenizer", TINY]
    pulled = subprocess.run(pull, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    return folder, tinker_server, env


def _run(command: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    return output


def _metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_math_rl_trains_and_resumes_with_its_renderer_from_the_run(cookbook, tmp_path):
    """``math_rl`` on arithmetic with ``renderer_name=role_colon``, three steps and a checkpoint; then a second run
    from that checkpoint without ``renderer_name``, which the recipe reads back from the training run's
    ``user_metadata`` (the run outlived its session)."""
    _, tinker_server, env = cookbook
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
    first = tmp_path / "first"
    _run([*recipe, *flags, "renderer_name=role_colon", "max_steps=3", f"log_path={first}"], env, tmp_path)
    metrics = _metrics(first)
    assert len(metrics) == 3 and all("env/all/reward/total" in m for m in metrics), metrics[-1]
    saved = [json.loads(line) for line in (first / "checkpoints.jsonl").read_text().splitlines()]
    state = saved[-1]["state_path"]
    rest = tinker.RestClient(base_url=tinker_server.url, api_key=tinker_server.key("cookbook"))
    assert rest.get_training_run_by_tinker_path(state).result().user_metadata["renderer_name"] == "role_colon"

    second = tmp_path / "second"
    output = _run(
        [*recipe, *flags, f"load_checkpoint_path={state}", "max_steps=1", f"log_path={second}"], env, tmp_path
    )
    assert "Could not fetch renderer metadata" not in output and len(_metrics(second)) == 1


def test_chat_sl_lowers_the_nll_on_its_example_conversations(cookbook, tmp_path):
    """``chat_sl`` on the cookbook's own ``example_data/conversations.jsonl``: three steps of supervised learning."""
    folder, tinker_server, env = cookbook
    conversations = folder / "example_data" / "conversations.jsonl"
    command = [
        sys.executable,
        "-m",
        "tinker_cookbook.recipes.chat_sl.train",
        f"model_name={TINY}",
        f"dataset={conversations}",
        "renderer_name=role_colon",
        "lora_rank=4",
        "batch_size=8",
        "max_length=256",
        "learning_rate=1e-2",
        "lr_schedule=constant",
        "max_steps=3",
        "eval_every=0",
        "save_every=0",
        f"base_url={tinker_server.url}",
        f"log_path={tmp_path / 'sl'}",
        "behavior_if_log_dir_exists=delete",
    ]
    _run(command, env, tmp_path)
    nll = [m["train_mean_nll"] for m in _metrics(tmp_path / "sl") if "train_mean_nll" in m]
    assert len(nll) == 3 and nll[-1] < nll[0], nll


DPO_DRIVER = """
import sys
from tinker_cookbook.preference import train_dpo
from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

model, data, log_path, url = sys.argv[1:]
common = ChatDatasetBuilderCommonConfig(
    model_name_for_tokenizer=model, renderer_name="role_colon", max_length=128, batch_size=4
)
builder = DPODatasetBuilderFromComparisons(
    comparison_builder=ComparisonBuilderFromJsonl(train_path=data), common_config=common
)
train_dpo.main(
    train_dpo.Config(
        log_path=log_path, model_name=model, recipe_name="opentinker_test_dpo", renderer_name="role_colon",
        dataset_builder=builder,
        learning_rate=1e-2, lr_schedule="constant", lora_rank=4, base_url=url, max_steps=2,
        save_every=0, eval_every=0, dpo_beta=0.1,
    )
)
"""


def test_dpo_learns_a_local_preference_file_through_forward_backward_custom(cookbook, tmp_path):
    """The cookbook's DPO trainer (``train_dpo.main``, its loss through ``forward_backward_custom``, the reference
    logprobs from a sampling client) on a small local preference file. Its CLI only takes hub datasets, so a few
    lines build its own ``ComparisonBuilderFromJsonl`` config; the trainer is unmodified."""
    _, tinker_server, env = cookbook
    rows = []
    for a, b in [(1, 2), (2, 3), (3, 4), (4, 5), (5, 1), (2, 2), (3, 1), (4, 4)]:
        prompt = [{"role": "user", "content": f"What is {a} plus {b}?"}]
        right, wrong = [{"role": "assistant", "content": str(a + b)}], [{"role": "assistant", "content": "I forget."}]
        rows.append({"comparison": {"prompt_conversation": prompt, "completion_A": right, "completion_B": wrong}})
        rows[-1]["label"] = "A"
    data = tmp_path / "preferences.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    log_path = tmp_path / "dpo"
    _run([sys.executable, "-c", DPO_DRIVER, TINY, str(data), str(log_path), tinker_server.url], env, tmp_path)
    losses = [m["dpo_loss"] for m in _metrics(log_path) if "dpo_loss" in m]
    assert len(losses) == 2 and losses[-1] < losses[0], losses  # 8 pairs, 4 a batch: one epoch
