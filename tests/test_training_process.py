"""Training in a child process (what ``opentinker train`` starts ahead of its flow run): every iteration comes back
in order, the export names the run it was handed, cancelling stops the child, and a failure brings its traceback."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import psutil
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


def test_ctrl_c_while_the_run_finishes_stops_the_child_after_its_iteration(tmp_path):
    """A terminal's Ctrl-C (SIGINT to the process group: parent and child) while the parent waits for a named run:
    the child stops after its iteration, checkpointed there, no export; the interrupt goes on in the parent."""
    code = (
        "import sys\n"
        "from opentinker.tasks.training_process import TrainingProcess\n"
        "from opentinker.tasks.spec import RunSpec\n"
        f"spec = RunSpec.model_validate_json({_spec(10_000_000).model_dump_json()!r})\n"
        f"process = TrainingProcess(spec, {str(tmp_path)!r})\n"
        "seen, finishing = [], []\n"
        "def on_iteration(metrics, step):\n"
        "    seen.append(step)\n"
        "    if len(finishing) == 1 and len(seen) > 1:  # an iteration after the main thread began to finish\n"
        "        print(process.pid, flush=True)\n"
        "        finishing.append(True)\n"
        "process.report_to(on_iteration)\n"
        "try:\n"
        "    finishing.append(True)\n"
        "    process.finish('run-123')\n"
        "except KeyboardInterrupt:\n"
        "    print(seen[-1], flush=True)\n"
        "    sys.exit(130)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a terminal's group
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # and its Ctrl-C (not a background job's)
    )
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        os.killpg(parent.pid, signal.SIGINT)
        assert parent.wait(30) == 130
        assert not child.is_running()  # the parent waited for it
        assert int(parent.stdout.readline()) < 10_000_000
        assert (tmp_path / "checkpoints" / "checkpoint.pt").exists() and not (tmp_path / "export").exists()
    finally:  # a failed check leaves no 1e7-step run behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)


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


@pytest.fixture
def warm(tmp_path, monkeypatch):
    """A data dir whose runs use the warm training process (``tasks.fork_server.TRAINING``), stopped at the end."""
    from opentinker.infra.settings import get_settings
    from opentinker.tasks import fork_server

    data = tmp_path / "data"
    monkeypatch.setenv("OPENTINKER_DATA_DIR", str(data))
    monkeypatch.setenv("OPENTINKER_WARM_PROCESS_IDLE_S", "120")
    get_settings.cache_clear()
    yield data
    fork_server.stop_servers(data)
    get_settings.cache_clear()


def _trained(directory):
    """A child's whole run: its per-iteration losses, returns and exported weights (no timings)."""
    import numpy as np

    process = TrainingProcess(_spec(640), directory)
    seen = []
    process.report_to(
        lambda metrics, step: seen.append(
            {k: v for k, v in metrics.items() if "/" in k and "sps" not in k and not k.startswith("perf/")}
        )
    )
    process.finish("run-1")
    weights = np.load(directory / "export" / "weights.npz")
    return process, seen, {name: weights[name] for name in weights.files}


def test_a_later_child_forks_from_the_warm_process_and_trains_bit_for_bit_alike(warm, tmp_path):
    """The first run starts the data dir's warm process as it ends; the next run's child is a fork of it (not of
    this process), and trains exactly as the fresh child did: same losses at every iteration, same weights."""
    import numpy as np

    from opentinker.tasks import fork_server

    fresh, fresh_seen, fresh_weights = _trained(tmp_path / "fresh")
    assert not fresh.forked
    assert fork_server.wait_ready(warm, timeout=120), (warm / "training" / "fork-server.log").read_text()
    forked, forked_seen, forked_weights = _trained(tmp_path / "forked")
    assert forked.forked and forked.pid != fresh.pid
    assert forked_seen == fresh_seen and len(forked_seen) == 10 and any("losses/" in k for k in forked_seen[0])
    assert forked_weights.keys() == fresh_weights.keys()
    assert all(np.array_equal(forked_weights[name], fresh_weights[name]) for name in fresh_weights)
    assert forked._process.returncode == 0  # reaped by the warm process, which reported its status


def test_the_fork_runs_with_the_callers_environment_directory_and_code(warm, tmp_path, monkeypatch):
    """What differs between callers crosses with the request: environment, working directory, import path (a user's
    module is imported in the child, never in the warm process), stdin/stdout; the exit status comes back, a signal's
    as its negative number. A request that finds no server (a stale socket of a killed one) gets None."""
    from opentinker.tasks import fork_server

    shadow = tmp_path / "started_here"  # the folder of the command that starts it: not on its import path
    shadow.mkdir()
    (shadow / "gymnasium.py").write_text("raise SystemExit('a file in the starting folder was imported')\n")
    monkeypatch.chdir(shadow)
    fork_server.start_server(warm, 120)
    assert fork_server.wait_ready(warm, timeout=120), (warm / "training" / "fork-server.log").read_text()
    code = tmp_path / "user_code"
    code.mkdir()
    (code / "echo_child.py").write_text(
        "import json, os, sys, time\n"
        "def main(argv):\n"
        "    if argv[1] == 'sleep':\n        time.sleep(600)\n"
        "    line = sys.stdin.readline().strip()\n"
        "    print(json.dumps({'line': line, 'mark': os.environ.get('MARK'), 'cwd': os.getcwd(), 'argv': argv[1:]}))\n"
        "    sys.exit(3)\n"
    )
    monkeypatch.setenv("MARK", "from the caller")
    monkeypatch.chdir(code)
    monkeypatch.syspath_prepend(str(code))
    child = fork_server.fork_child(warm, ["echo_child", "talk"])
    assert child is not None
    child.stdin.write("hello\n")
    child.stdin.close()
    answer = json.loads(child.stdout.readline())
    assert answer == {"line": "hello", "mark": "from the caller", "cwd": str(code), "argv": ["talk"]}
    assert child.wait() == 3
    sleeper = fork_server.fork_child(warm, ["echo_child", "sleep"])
    os.kill(sleeper.pid, 9)
    assert sleeper.wait() == -9

    import psutil

    started = [
        p for p in psutil.process_iter(["cmdline", "create_time"]) if str(warm) in " ".join(p.info["cmdline"] or [])
    ]
    server = min(started, key=lambda p: p.info["create_time"])  # its forks share its command line
    server.kill()
    server.wait(10)
    assert fork_server.socket_path(warm).exists()  # a killed server leaves its socket behind
    assert fork_server.fork_child(warm, ["echo_child", "talk"]) is None


def test_the_warm_process_leaves_when_idle_and_a_changed_thread_setting_gets_its_own(tmp_path, monkeypatch):
    """Idle for its time, it exits and removes its socket; a caller whose import-time environment differs (torch's
    thread count) is never served by it."""
    from opentinker.tasks import fork_server

    fork_server.start_server(tmp_path, 1.0)
    assert fork_server.wait_ready(tmp_path, timeout=120)
    deadline = time.monotonic() + 30
    while fork_server.socket_path(tmp_path).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not fork_server.socket_path(tmp_path).exists(), "the idle warm process did not exit"
    before = fork_server.socket_path(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert fork_server.socket_path(tmp_path) != before
