"""`opentinker.connect()` then the article's first example as printed (5e4 steps where it says 1e6: the local run of
the whole example is tests/test_article_examples.py's; here the suite's budget holds a tenth): the training runs as a
job on a real `opentinker server up`, its progress shows here, and `evaluate()`/`deploy()` act on the job's
registered model."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

pytestmark = pytest.mark.slow

EXAMPLE_1 = """
from opentinker import RemoteEnv, PPOTrainer
env = RemoteEnv('CartPole-v1')            # the env instance runs on the cluster
trainer = PPOTrainer(env, policy='MLP')
trainer.train(steps=5e4)                  # triggers distributed training (note: a float)
# deploying as an API service takes one line
service = trainer.deploy(api_key='your_key')
"""


def test_connect_then_the_articles_first_example_runs_as_a_server_job(job_server, tmp_path):
    server = job_server
    key = server.make_key("article")
    script = tmp_path / "example_1.py"
    script.write_text(
        f"import opentinker\nopentinker.connect({server.url!r}, api_key={key!r})\n"
        + EXAMPLE_1
        + "job = trainer.remote_job.job\n"
        "print('RESULT', job['id'], service.predict([0.0, 0.1, 0.0, -0.1]), trainer.global_step,\n"
        "      trainer.evaluate(episodes=5).mean, service.url)\n"
        "service.stop()\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=900, cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "COLUMNS": "120"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    job_id, action, steps, mean, url = done.stdout.split("RESULT")[1].split()
    assert int(action) in (0, 1) and int(steps) >= 50_000 and float(mean) > 50.0  # learning (random: ~22)
    assert "50000/50000" in done.stdout and "succeeded" in done.stdout  # the progress bar ran here
    headers = server.headers(key)
    job = httpx.get(f"{server.url}/v1/jobs/{job_id}", headers=headers, timeout=60).json()
    assert job["state"] == "SUCCEEDED" and job["env_id"] == "CartPole-v1" and job["steps"] == 50_000
    assert httpx.get(f"{server.url}/v1/services", headers=headers, timeout=60).json() == []  # stopped
    with pytest.raises(httpx.TransportError):
        httpx.post(f"{url}/act", json={"obs": [0.0] * 4}, timeout=5)
    # Without connect() the same code trains here, as before (checked by tests/test_article_examples.py).
