"""Training in a child process (what ``opentinker train`` starts ahead of its flow run): every iteration comes back
in order, the export names the run it was handed, cancelling stops the child, and a failure brings its traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from opentinker.tasks.training_process import TrainingProcess, start_early


def _spec(steps, env_id="CartPole-v1", checkpoint_every=None):
    from opentinker.tasks.spec import RunSpec

    engine = {"algorithm": "ppo", "num_envs": 4, "backend": "local", "n_steps": 16, "hidden_sizes": [16]}
    return RunSpec(env_id=env_id, steps=steps, seed=3, engine=engine, checkpoint_every=checkpoint_every)


def test_the_child_reports_every_iteration_then_exports_for_the_named_run(tmp_path):
    process = TrainingProcess(_spec(640), tmp_path)
    seen = []
    process.report_to(lambda metrics, step: seen.append((step, metrics["charts/sps"])))
    done = process.finish("run-123")
    assert process.pid != os.getpid()
    assert [step for step, _ in seen] == list(range(64, 640 + 1, 64))
    assert all(sps > 0 for _, sps in seen)
    assert done["start_step"] == 0 and done["global_step"] == 640 and done["seconds"] > 0
    metadata = json.loads((tmp_path / "export" / "policy.json").read_text())["metadata"]
    assert metadata["run_id"] == "run-123" and metadata["env_id"] == "CartPole-v1"
    assert (tmp_path / "checkpoints" / "checkpoint.pt").exists()


def test_cancelling_stops_the_child_after_its_current_iteration(tmp_path):
    process = TrainingProcess(_spec(10_000_000, checkpoint_every=64), tmp_path)
    seen = []
    process.report_to(lambda metrics, step: seen.append(step))
    deadline = time.monotonic() + 60
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen, "the child reported no iteration"
    started = time.monotonic()
    process.cancel()
    assert time.monotonic() - started < 10
    assert seen[-1] < 10_000_000 and (tmp_path / "checkpoints" / "checkpoint.pt").exists()
    assert not (tmp_path / "export").exists()


def test_a_failing_child_raises_with_its_traceback(tmp_path):
    process = TrainingProcess(_spec(640, env_id="NoSuchEnv-v9"), tmp_path)
    process.report_to(lambda metrics, step: None)
    with pytest.raises(RuntimeError, match=rf"pid {process.pid}[\s\S]*NoSuchEnv-v9"):
        process.finish("run-123")


def test_the_cli_starts_the_child_before_prefect_and_mlflow_are_imported(tmp_path):
    """``opentinker train`` starts the child first (``start_early``), from a module that imports neither Prefect nor
    MLflow (their imports are seconds of the command's start); a spec that cannot train ahead (Ray) gets none."""
    code = (
        "import sys\n"
        "from opentinker.tasks.training_process import start_early\n"
        "from opentinker.tasks.spec import RunSpec\n"
        f"spec = RunSpec.model_validate_json({_spec(640).model_dump_json()!r})\n"
        "process = start_early(spec)\n"
        "print(sorted({'prefect', 'mlflow', 'torch'} & set(sys.modules)), process is not None)\n"
        "process.cancel()\n"
    )
    env = {**os.environ, "OPENTINKER_DATA_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.split("\n")[0] == "[] True", done.stdout + done.stderr
    assert (tmp_path / "runs" / _spec(640).resolved_run_name).is_dir()
    ray = _spec(640).model_copy(update={"engine": _spec(640).engine.model_copy(update={"backend": "ray"})})
    assert start_early(ray) is None
