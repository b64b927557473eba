"""The warm executor's task processes end with the executor: a SuperNode stopped mid-message leaves no process.

Flower's ClientApp runtime checks its parent by raising SIGINT, which its retrying Runtime API calls swallow; a task
forked by the executor whose node is gone kept retrying forever (found as an orphan after a test session)."""

import subprocess
import sys

from opentinker.infra.processes import free_ports


def test_a_task_process_ends_once_its_executor_is_gone():
    executor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    port = free_ports(1)[0]  # nothing listens there: the task's pulls retry, as against a stopped SuperNode
    task = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from opentinker.federated.warm_executor import run_task; "
            f"run_task('127.0.0.1:{port}', 'token', {executor.pid})",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        executor.kill()
        executor.wait()  # reaped: its pid is gone, not a zombie
        assert task.wait(timeout=60) == 0
    finally:
        for process in (executor, task):
            process.kill()
            process.wait()
