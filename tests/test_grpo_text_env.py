"""The built-in GRPO on a user's own text env (prompts, verifier, splits defined here, not a shipped task): from the
SDK's ``GRPOTrainer`` and from ``opentinker train module:factory --algo grpo``, on the tiny model built in code."""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlflow
import pytest
from typer.testing import CliRunner

from opentinker.envs.text import TextEnv, TextExample
from opentinker.infra.settings import get_settings

CACHE = str(Path(tempfile.gettempdir()) / "opentinker-test-llm-cache")  # shared with the other tiny-model tests
SMALL = {
    "cache_dir": CACHE,
    "group_size": 4,
    "prompts_per_step": 2,
    "max_new_tokens": 4,
    "temperature": 1.0,
    "learning_rate": 5e-2,
    "eval_prompts": 3,
    "eval_batch": 3,
}


def capitals(answer: str, example: TextExample) -> float:
    """The user's verifier: the share of the reply's letters written as capitals."""
    letters = [c for c in answer if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(len(letters), 1)


def make_shout_env(split: str = "train") -> TextEnv:
    """The user's factory: its own prompts per split (the held-out ones never trained on) and its own verifier."""
    prompts = [f"Shout {word}." for word in ("ahoy", "yes", "run", "go", "now", "stop")]
    heldout = [f"Whisper {word}, then shout it." for word in ("bye", "later", "soon")]
    return TextEnv([TextExample(p, "") for p in (prompts if split == "train" else heldout)], reward_fn=capitals)


def test_grpo_trainer_takes_a_user_text_env_factory():
    from opentinker import GRPOTrainer

    trainer = GRPOTrainer(make_shout_env, base_model="tiny", seed=2, **SMALL)
    try:
        seen: list[tuple[int, float]] = []
        trainer.train(2, callback=lambda metrics, update: seen.append((update, metrics["train/reward_mean"])))
        result = trainer.evaluate()
    finally:
        trainer.close()
    assert trainer.updates == 2 and [update for update, _ in seen] == [1, 2]  # the budget counts optimiser updates
    assert trainer.config.task == "test_grpo_text_env:make_shout_env"  # recorded as the factory's path
    assert {episode.prompt for episode in result.episodes} == {e.prompt for e in make_shout_env("heldout").examples}
    assert all(episode.reward == capitals(episode.answer, None) for episode in result.episodes)  # the user's verifier


@pytest.mark.slow  # trains through a flow
def test_cli_trains_a_user_text_env_with_grpo_and_registers_the_adapter(tmp_path):
    config = tmp_path / "shout.toml"
    cache = f'cache_dir = "{CACHE}"\n'
    config.write_text(
        'backend = "local"\nworkers = 1\nrun_name = "user-shout"\nmodel_name = "user-shout-agent"\n'
        f'[grpo]\nbase_model = "tiny"\n{cache}group_size = 2\nprompts_per_step = 2\nmax_new_tokens = 4\n'
        "eval_prompts = 3\neval_batch = 3\n"
    )
    from opentinker.cli import app

    env_ref = "test_grpo_text_env:make_shout_env"
    result = CliRunner().invoke(
        app, ["train", env_ref, "--algo", "grpo", "--steps", "2", "--config", str(config)]
    )  # --steps: GRPO's earlier spelling of --updates
    assert result.exit_code == 0, result.output
    assert "Held-out success" in result.output
    client = mlflow.MlflowClient(get_settings().tracking_uri)
    version = client.get_model_version_by_alias("user-shout-agent", "candidate")
    assert version.tags["task"] == env_ref and version.tags["base_model"] == "tiny"
    run = client.get_run(version.run_id)
    assert run.data.params["env_id"] == env_ref and run.data.params["updates"] == "2"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/reward_mean")] == [1, 2]
    heldout = mlflow.load_table("episodes/heldout_step_000002.json", run_ids=[run.info.run_id])
    assert set(heldout["prompt"]) == {e.prompt for e in make_shout_env("heldout").examples}
