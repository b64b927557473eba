"""The warm executor's task processes end with the executor: a SuperNode stopped mid-message leaves no process.

Flower's ClientApp runtime checks its parent by raising SIGINT, which its retrying Runtime API calls swallow; a task
forked by the executor whose node is gone kept retrying forever (found as an orphan after a test session, stuck
pulling a message's objects). That stall needs a node that dies mid-pull and is not reproduced here (in the phase
below Flower's own check also ends the task): this pins the contract, a task ends once its executor is gone."""

import socket
import subprocess
import sys


def test_a_task_process_retrying_a_gone_node_ends_once_its_executor_is_gone():
    executor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with socket.create_server(("127.0.0.1", 0)) as runtime_api:  # a SuperNode's Runtime API that stops answering
        runtime_api.settimeout(120)
        port = runtime_api.getsockname()[1]
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
            connection, _ = runtime_api.accept()  # the task waits for its message, which never comes
        except BaseException:
            task.kill()
            raise
    try:
        executor.kill()
        executor.wait()  # reaped: its pid is gone, not a zombie
        assert task.wait(timeout=60) == 0
    finally:
        connection.close()
        for process in (executor, task):
            process.kill()
            process.wait()
