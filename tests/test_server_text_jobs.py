"""GRPO jobs on a real `opentinker server up` (its Prefect server and sandboxed worker, MLflow, over HTTP): a shipped
text task submitted through the client, and a user's own ``TextEnv`` factory uploaded from a temp dir that is not on
the server's path by ``opentinker submit module:factory --algo grpo``, each train the tiny model built in code and
register its adapter in the tenant's namespace."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from fixtures.server import wait_for_job

pytestmark = pytest.mark.slow

FINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
GRPO_TOML = textwrap.dedent(
    """
    backend = "local"
    workers = 1
    [grpo]
    base_model = "tiny"
    group_size = 2
    prompts_per_step = 2
    max_new_tokens = 4
    eval_prompts = 2
    eval_batch = 2
    """
)
"""One GRPO update of 2 x 2 four-token completions on the tiny model (tests check the plumbing, not the learning)."""
GRPO = {
    "algorithm": "grpo",
    "updates": 1,
    "backend": "local",
    "workers": 1,
    "grpo": {"base_model": "tiny", "group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4},
}
SHOUT_TASKS = '''
"""A user's text env: its own prompts per split and its own verifier (the share of capitals in the reply)."""
from opentinker.envs.text import TextEnv, TextExample


def capitals(answer, example):
    letters = [c for c in answer if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(len(letters), 1)


def make_env(split="train"):
    words = ("ahoy", "yes", "run", "go") if split == "train" else ("bye", "later")
    return TextEnv([TextExample(f"Shout {word}.", "") for word in words], reward_fn=capitals)
'''


def _registered(server, key: str, job: dict, tenant: str, env_id: str) -> dict:
    """The job's result, checked: a version of the tenant's model, registered from an MLflow run of its experiment
    that trained ``env_id``."""
    import mlflow

    answer = httpx.get(f"{server.url}/v1/jobs/{job['id']}/result", headers=server.headers(key), timeout=60)
    assert answer.status_code == 200, answer.text
    result = answer.json()
    assert result["model_name"].startswith(f"{tenant}.") and result["model_version"] == "1", result
    assert result["decision"].startswith("promoted v1") and result["aliases"] == ["candidate", "champion"]
    assert 0.0 <= result["heldout_success"] <= 1.0 and result["global_step"] == 1  # GRPO counts updates
    store = f"sqlite:///{server.data_dir / 'tenants' / tenant / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=store, registry_uri=store)
    version = client.get_model_version(result["model_name"], result["model_version"])
    assert version.tags["task"] == env_id and version.tags["base_model"] == "tiny"
    run = client.get_run(result["run_id"])
    assert run.info.experiment_id == client.get_experiment_by_name(f"tenant-{tenant}").experiment_id
    assert run.data.params["env_id"] == env_id and run.data.params["updates"] == "1"
    # The job read the server's converted base model (read-only); the tenant stores no copy of its own.
    assert (server.data_dir / "llm-cache").is_dir() and not (
        server.data_dir / "tenants" / tenant / "llm-cache"
    ).exists()
    # An adapter is no numpy policy: downloading or serving it as one is refused in words, not with a 500.
    headers = server.headers(key)
    policy = httpx.get(f"{server.url}/v1/jobs/{job['id']}/policy", headers=headers, timeout=60)
    serve = httpx.post(f"{server.url}/v1/services", json={"job_id": job["id"]}, headers=headers, timeout=60)
    for answer in (policy, serve):
        assert answer.status_code == 409 and "language-model adapter" in answer.json()["detail"], answer.text
    return result


def test_a_shipped_text_task_trains_with_grpo_as_a_job(job_server):
    from opentinker.server.client import Client

    server = job_server
    key = server.make_key("words")
    job = Client(server.url, key).submit({"env_id": "arithmetic", **GRPO, "seed": 1})
    assert job["algorithm"] == "grpo" and job["steps"] == 1
    done = wait_for_job(server, key, job["id"], lambda s: s["state"] in FINAL)
    assert done["state"] == "SUCCEEDED", done
    _registered(server, key, done, "words", "arithmetic")


def test_submit_uploads_a_user_text_env_and_trains_it_with_grpo(job_server, tmp_path):
    server = job_server
    key = server.make_key("shouty")
    code = tmp_path / "code"  # the user's package: `opentinker submit` runs in its parent folder, never the server's
    (code / "shout_pkg").mkdir(parents=True)
    (code / "shout_pkg" / "__init__.py").write_text("")
    (code / "shout_pkg" / "tasks.py").write_text(SHOUT_TASKS)
    (tmp_path / "grpo.toml").write_text(GRPO_TOML)
    env = {
        **os.environ,
        "OPENTINKER_SERVER_URL": server.url,
        "OPENTINKER_API_KEY": key,
        "OPENTINKER_DATA_DIR": str(tmp_path / "laptop"),
        "COLUMNS": "120",
    }
    env_id = "shout_pkg.tasks:make_env"
    done = subprocess.run(
        [str(Path(sys.executable).parent / "opentinker"), "submit", env_id, "--algo", "grpo", "--steps", "1",
         "--config", str(tmp_path / "grpo.toml")],
        env=env, capture_output=True, text=True, cwd=code, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Model: shouty." in done.stdout and "Held-out success:" in done.stdout, done.stdout
    job_id = done.stdout.split("job ", 1)[1].split()[0]
    status = httpx.get(f"{server.url}/v1/jobs/{job_id}", headers=server.headers(key), timeout=60).json()
    assert status["state"] == "SUCCEEDED" and status["env_id"] == env_id and status["algorithm"] == "grpo"
    _registered(server, key, status, "shouty", env_id)
