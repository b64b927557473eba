"""The data dir's own Prefect server (``infra.local_prefect``): ``opentinker train`` with no Prefect API configured
starts it once, later runs adopt it, a killed one is replaced, ``opentinker down`` stops it."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from opentinker.infra.processes import ServiceProcess

pytestmark = pytest.mark.slow

CONFIG = "num_envs = 4\neval_episodes = 2\nchampion_threshold = 0.0\n[ppo]\nn_steps = 32\nhidden_sizes = [16]\n"


def _env(root: Path) -> dict[str, str]:
    """A user's environment: the data dir under ``root``, no Prefect API configured, the warm processes on (the
    default)."""
    unset = ("PREFECT_API_URL", "OPENTINKER_PREFECT_API_URL", "OPENTINKER_WARM_PROCESS_IDLE_S")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(OPENTINKER_DATA_DIR=str(root / "data"), PREFECT_HOME=str(root / "prefect-client"), COLUMNS="200")
    return env


def _cli(args: list[str], root: Path, background: bool = False) -> subprocess.CompletedProcess:
    """``opentinker ARGS`` as a user runs it (``_env``); ``background``: as ``nohup ... &`` in a script (SIGHUP,
    SIGINT and SIGQUIT ignored, and so by what it starts), else as a terminal's command (their default)."""
    done = subprocess.run(
        [str(Path(sys.executable).parent / "opentinker"), *args],
        env=_env(root),
        cwd=root,
        text=True,
        capture_output=True,
        timeout=300,
        preexec_fn=functools.partial(_signals, signal.SIG_IGN if background else signal.SIG_DFL),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _signals(disposition) -> None:
    """In a child before it runs a command: what a terminal's Ctrl-C, hang-up and quit do to it (a test session may
    itself run in the background, ignoring them)."""
    for number in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT):
        signal.signal(number, disposition)


def _recorded(root: Path) -> ServiceProcess:
    state = json.loads((root / "data" / "prefect" / "services.json").read_text())
    return ServiceProcess.from_dict(state["prefect"])


def _train(root: Path, name: str, background: bool = False) -> tuple[str, str, str, str]:
    """One small ``opentinker train``: the flow run id its MLflow run names, what it printed, and how its training
    child and its own flow process started (``warm``: forked from the data dir's warm processes; ``fresh``)."""
    import mlflow

    args = ["train", "CartPole-v1", "--steps", "512", "--config", str(root / "train.toml"), "--seed", name]
    done = _cli(args, root, background)
    client = mlflow.MlflowClient(f"sqlite:///{root / 'data' / 'mlflow.db'}")
    (run,) = client.search_runs(
        [client.get_experiment_by_name("opentinker").experiment_id], f"attributes.run_name = 'cartpole-v1-seed{name}'"
    )
    tags = run.data.tags
    return tags["prefect.flow_run_id"], done.stdout, tags["opentinker.training_start"], tags["opentinker.flow_start"]


def test_train_runs_reuse_the_data_dirs_prefect_server_and_down_stops_it(tmp_path):
    """...and its warm processes: the first run starts them as it ends; the next command is a fork of the warm flow
    process, and its training child a fork of the warm training process."""
    from opentinker.tasks import fork_server

    (tmp_path / "train.toml").write_text(CONFIG)
    try:
        # The first run starts the warm processes: from a script's background job, so they ignore Ctrl-C, which a
        # later command's fork must not inherit.
        first_run, printed, *start = _train(tmp_path, "1", background=True)
        first = _recorded(tmp_path)
        assert first.alive() and start == ["fresh", "fresh"]
        assert f"Prefect UI: {first.url}/runs  (this data dir's server; `opentinker down` stops it)" in printed
        assert fork_server.wait_ready(tmp_path / "data", timeout=120)
        assert fork_server.wait_ready(tmp_path / "data", 120, fork_server.FLOW, _env(tmp_path))
        second_run, printed, *start = _train(tmp_path, "2")
        assert start == ["warm", "warm"]
        assert "Evaluation: mean return" in printed and f"Prefect UI: {first.url}/runs" in printed  # on its stdout
        assert (_recorded(tmp_path).pid, _recorded(tmp_path).url) == (first.pid, first.url)  # adopted, not restarted
        # Both flow runs are in the one server's history (its own database, under the data dir).
        answer = httpx.post(f"{first.url}/api/flow_runs/filter", json={}).raise_for_status().json()
        assert {first_run, second_run} <= {run["id"] for run in answer}

        os.kill(first.pid, signal.SIGKILL)  # a server that died (or was killed) is replaced by the next run
        psutil.Process(first.pid).wait(10)
        third_run, *_ = _train(tmp_path, "3")
        third = _recorded(tmp_path)
        assert third.pid != first.pid and third.alive()
        answer = httpx.post(f"{third.url}/api/flow_runs/filter", json={}).raise_for_status().json()
        assert third_run in {run["id"] for run in answer}

        # A forked command lives and dies with its caller: Ctrl-C is passed on, a killed caller's fork is stopped,
        # and with it the fork's own training child; whether the flow has adopted that child yet (its run's
        # workers.json) or not. Ctrl-C stops the training after its iteration, checkpointed there.
        servers = _warm_servers(tmp_path)
        train = [str(Path(sys.executable).parent / "opentinker"), "train", "CartPole-v1", "--steps", "100000000"]
        for seed, sent, adopted, exit_code in (
            (10, signal.SIGINT, False, 130),
            (11, signal.SIGINT, True, 130),
            (12, signal.SIGKILL, True, -signal.SIGKILL),
        ):
            run = tmp_path / "data" / "runs" / f"cartpole-v1-seed{seed}"
            caller = subprocess.Popen(
                [*train, "--seed", str(seed)],
                env=_env(tmp_path),
                cwd=tmp_path,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=functools.partial(_signals, signal.SIG_DFL),
            )
            forks = _eventually(lambda: all(server.children() for server in servers) and servers)
            forks = [child for server in forks for child in server.children()]
            if adopted:
                _eventually(lambda run=run: (run / "workers.json").exists())
            caller.send_signal(sent)
            assert caller.wait(60) == exit_code, f"{sent!r} (adopted: {adopted})"
            _, alive = psutil.wait_procs(forks, timeout=30)
            assert not alive, f"{sent!r} (adopted: {adopted}): forks left running: {alive}"
            if sent == signal.SIGINT and adopted:
                assert (run / "checkpoints" / "checkpoint.pt").exists()

        stopped = _cli(["down"], tmp_path).stdout
        assert "stopped the local Prefect server" in stopped and "stopped the warm processes (2)" in stopped
        assert not third.alive() and not third.family()
        assert not list((tmp_path / "data" / "training").glob("*.sock"))
        assert "no local Prefect server" in _cli(["down"], tmp_path).stdout
    finally:
        from opentinker.infra.local_prefect import stop_local_prefect
        from opentinker.infra.settings import Settings

        stop_local_prefect(Settings(data_dir=tmp_path / "data"))
        fork_server.stop_servers(tmp_path / "data")


def _warm_servers(root: Path) -> list[psutil.Process]:
    """The data dir's two warm processes (their forks share their command line: these are the forks' parents)."""
    found = [
        process
        for process in psutil.process_iter(["cmdline"])
        if "opentinker.tasks.fork_server" in (process.info["cmdline"] or [])
        and str(root / "data") in " ".join(process.info["cmdline"])
    ]
    servers = [process for process in found if process.ppid() not in {other.pid for other in found}]
    assert len(servers) == 2, servers
    return servers


def _eventually(condition, timeout: float = 60.0):
    """``condition()``'s first true value within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
    return value
