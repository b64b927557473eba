"""`opentinker stack up|status|down` as a user runs it: real services that outlive the command, on free ports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from opentinker.infra.files import atomic_write
from opentinker.infra.processes import ServiceError, ServiceProcess, http_ok
from opentinker.infra.s3 import s3_client
from opentinker.infra.services import start_mlflow
from opentinker.infra.settings import Settings
from opentinker.infra.stack import Stack


def _cli(data_dir: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OPENTINKER_DATA_DIR": str(data_dir), "COLUMNS": "200"}
    return subprocess.run(
        [str(Path(sys.executable).parent / "opentinker"), *args],
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_stack_up_status_down(tmp_path):
    data_dir = tmp_path / "data"
    up = _cli(data_dir, "stack", "up", "--no-ui")
    stack = Stack(root=data_dir / "stack", settings=Settings(data_dir=data_dir))
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        services = stack.services()
        assert set(services) == {"s3", "mlflow", "prefect"}
        assert all(service.alive() for service in services.values()), "services must outlive `stack up`"
        ports = [port for service in services.values() for port in service.ports.values()]
        assert len(ports) == len(set(ports))

        status = _cli(data_dir, "stack", "status", "--env")
        env = dict(line.removeprefix("export ").split("=", 1) for line in status.stdout.splitlines())
        settings = Settings(
            data_dir=data_dir,
            s3_endpoint_url=env["OPENTINKER_S3_ENDPOINT_URL"],
            s3_access_key=env["OPENTINKER_S3_ACCESS_KEY"],
            s3_secret_key=env["OPENTINKER_S3_SECRET_KEY"],
            s3_bucket=env["OPENTINKER_S3_BUCKET"],
        )
        client = s3_client(settings)
        client.put_object(Bucket=settings.s3_bucket, Key="hello.txt", Body=b"from the stack test")
        assert client.get_object(Bucket=settings.s3_bucket, Key="hello.txt")["Body"].read() == b"from the stack test"
        assert http_ok(f"{env['OPENTINKER_MLFLOW_TRACKING_URI']}/health")
        with urllib.request.urlopen(f"{env['OPENTINKER_PREFECT_API_URL']}/health", timeout=10) as response:
            assert json.load(response) is True
        assert (data_dir / "stack" / "stack.env").read_text().count("export OPENTINKER_") == 7
        secret = env["OPENTINKER_S3_SECRET_KEY"]
        holders = [
            path
            for path in (data_dir / "stack").rglob("*")
            if path.is_file() and path.suffix != ".log" and secret in path.read_text(errors="replace")
        ]
        assert "state.json" not in {path.name for path in holders}
        assert holders and all(path.stat().st_mode & 0o077 == 0 for path in holders), [
            (str(path), oct(path.stat().st_mode)) for path in holders
        ]

        table = _cli(data_dir, "stack", "status").stdout
        assert table.count("running") == 3 and services["mlflow"].url in table

        again = _cli(data_dir, "stack", "up", "--no-ui")  # already running: same processes, nothing new
        assert again.returncode == 0
        assert {n: s.pid for n, s in stack.services().items()} == {n: s.pid for n, s in services.items()}
    finally:
        down = _cli(data_dir, "stack", "down")
    assert down.returncode == 0 and "stopped" in down.stdout
    for service in services.values():
        assert not psutil.pid_exists(service.pid) or not service.alive()
    after = _cli(data_dir, "stack", "status")
    assert after.stdout.count("stopped") == 3 and "running" not in after.stdout
    assert _cli(data_dir, "stack", "status", "--env").stdout.strip() == ""


def test_down_never_signals_a_process_it_did_not_start(tmp_path):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        real_start = psutil.Process(bystander.pid).create_time()
        impostor = ServiceProcess(
            name="mlflow",
            pid=bystander.pid,
            create_time=real_start - 1000,
            url="http://127.0.0.1:1",
            log=str(tmp_path / "x.log"),
        )
        atomic_write(tmp_path / "stack" / "state.json", json.dumps({"services": {"mlflow": impostor.to_dict()}}))
        stack = Stack(root=tmp_path / "stack", settings=Settings(data_dir=tmp_path))
        assert stack.down() == []
        time.sleep(0.5)
        assert bystander.poll() is None, "a recycled pid must not be killed"
        assert [row.running for row in stack.status()] == [False, False, False]
    finally:
        bystander.kill()
        bystander.wait()


def test_stop_spares_a_stranger_holding_a_dead_leaders_pid(tmp_path):
    """A recycled pid that leads its own session (any service started by anyone) is not the dead service's group."""
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        started = psutil.Process(stranger.pid).create_time()
        dead = ServiceProcess(
            name="prefect",
            pid=stranger.pid,
            create_time=started - 100,
            url="http://127.0.0.1:1",
            log=str(tmp_path / "x.log"),
        )
        assert dead.family() == []
        dead.stop(timeout=1)
        assert stranger.poll() is None, "stopping a dead service must not signal the process that reused its pid"
    finally:
        stranger.kill()
        stranger.wait()


def test_a_service_that_dies_reports_its_log_tail(tmp_path):
    with pytest.raises(ServiceError, match=r"(?s)mlflow exited before .*Last lines of .*mlflow\.log"):
        start_mlflow(
            tmp_path / "mlflow",
            tmp_path / "mlflow.log",
            s3=None,
            backend_store_uri="nosuchscheme://nowhere",
            timeout=120,
        )


def test_unknown_backend_is_rejected(tmp_path):
    from opentinker.infra.stack import StackError

    with pytest.raises(StackError, match="backend must be one of sqlite, postgres"):
        Stack(root=tmp_path / "stack", settings=Settings(data_dir=tmp_path)).up(backend="mysql")
