"""A SuperNode's long-running app executor, for ``flower-supernode --isolation process``.

Flower 1.42 has no long-running ``flwr-clientapp``: its ``flower-superexec`` starts a fresh one per message (one
task token per process), and every start imports Python, Flower's CLI, torch, gymnasium and the project again —
2.5–3 s of CPU per message against ~0.1 s of the app's own work (`docs/federated.md`). This executor does the
SuperExec's job with Flower's own parts — it claims each task from the SuperNode's Runtime API (``AcquireTask``,
signed with the SuperNode's SuperExec secret) and runs it with Flower's ``run_clientapp`` in its own process — but
that process is forked from a fork server that imported all of it once. Isolation is unchanged (one process per
task, nothing shared between tasks); a task starts in milliseconds.

    python -c "from opentinker.federated.warm_executor import main; main()" --runtime-api-address 127.0.0.1:PORT \
        --auth-secret-file FILE --parent-pid SUPERNODE_PID   # -c, not -m: task processes need no __main__ module
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import threading
import time
from pathlib import Path

READY_MARKER = "warm executor ready"
PRELOAD = [
    "flwr.supernode.runtime.run_clientapp",
    "opentinker.federated.client_app",
    "opentinker.agents.ppo",
    "opentinker.federated.warm_executor",
]
"""Imported once by the fork server; every task process starts with them loaded."""
TASK_POLL_S = 0.1
"""Seconds between task claims (Flower's SuperExec: ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``, 1 s by default)."""


def run_task(runtime_api_address: str, token: str, executor_pid: int) -> None:
    """One task in its own process: Flower's ClientApp runtime (pull message, run the app, push the reply). It ends
    with the executor: Flower's own parent check raises SIGINT, which its retrying pulls swallow, so a task whose
    SuperNode was stopped mid-message would retry forever (and keep the fork server alive)."""
    from flwr.supernode.runtime.run_clientapp import run_clientapp

    _exit_with(executor_pid)

    run_clientapp(runtime_api_address=runtime_api_address, token=token, insecure=True, parent_pid=executor_pid)


def _warm_up() -> None:
    """Runs in one forked task process at start: proves the preloaded imports work before the node gets work."""


def _exit_with(parent_pid: int) -> None:
    """End at once when ``parent_pid`` is gone (Flower's own monitor raises SIGINT, which a retrying Runtime API call
    swallows): the executor follows its SuperNode, each task process its executor, and the fork server exits once
    neither is left."""

    def watch() -> None:
        while True:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(0)
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()


def serve(runtime_api_address: str, auth_secret: bytes, parent_pid: int | None) -> None:
    """Claim ClientApp tasks until the SuperNode goes away; each runs in a process forked from the fork server."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=no-name-in-module
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor, SuperExecAuthHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    if parent_pid is not None:
        _exit_with(parent_pid)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    warm = context.Process(target=_warm_up)
    warm.start()
    warm.join()
    if warm.exitcode != 0:
        raise SystemExit(f"warm executor: the preloaded task process failed (exit code {warm.exitcode})")
    auth = SuperExecAuthHttpInterceptor(
        master_secret=auth_secret, protected_methods=frozenset({"/flwr.proto.Runtime/AcquireTask"})
    )
    client = RuntimeHttpClient.from_server_address(
        server_address=runtime_api_address,
        insecure=True,
        root_certificates=None,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec"), auth],
        retry_invoker=make_simple_http_retry_invoker(),
    )
    print(READY_MARKER, flush=True)
    request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
    while True:
        claimed = client.AcquireTask(request)
        if claimed.HasField("task") and claimed.token:
            context.Process(target=run_task, args=(runtime_api_address, claimed.token, os.getpid())).start()
        multiprocessing.active_children()  # reap finished task processes
        time.sleep(TASK_POLL_S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime-api-address", required=True, help="the SuperNode's Runtime API (its --port)")
    parser.add_argument(
        "--auth-secret-file",
        required=True,
        type=Path,
        help="the file given to the SuperNode as --superexec-auth-secret-file",
    )
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process (the SuperNode) exits")
    args = parser.parse_args()
    serve(args.runtime_api_address, args.auth_secret_file.read_bytes(), args.parent_pid)
