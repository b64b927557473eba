"""Inside a job's sandbox: report training progress to the server, then run the flow run as Prefect's engine does.

The worker starts ``python -m opentinker.server.job_entry`` with ``PREFECT__FLOW_RUN_ID`` and the attempt's token
(``OPENTINKER_JOB_TOKEN``) in an environment that holds nothing else of the server's. Without network (the embedded
stack), ``OPENTINKER_JOB_PROXY`` names the worker's proxy socket: Prefect's client reaches it through a forwarder on
the sandbox's own loopback (``job_proxy.PROXY_PORT``). Progress goes out at most twice a second from a background
thread, so a slow server never slows training; a report that fails is dropped (the next one carries newer figures).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import urllib.request
import uuid

REPORT_EVERY_S = 0.5


class ProgressReporter:
    """A ``tracking.progress`` listener that posts the latest (step, total, metrics) to the server."""

    def __init__(self, url: str, token: str):
        self.url = url
        self.token = token
        self._latest: dict | None = None
        self._wake = threading.Event()
        threading.Thread(target=self._send_loop, name="progress", daemon=True).start()

    def __call__(self, step: int, total: int, metrics: dict[str, float]) -> None:
        wanted = ("charts/sps", "charts/episodic_return_mean")
        self._latest = {
            "step": int(step),
            "total": int(total),
            "metrics": {k: float(metrics[k]) for k in wanted if k in metrics},
        }
        self._wake.set()

    def _send_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            body, self._latest = self._latest, None
            if body is None:
                continue
            request = urllib.request.Request(
                self.url,
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"},
            )
            try:
                urllib.request.urlopen(request, timeout=5).close()
            except OSError:
                pass
            threading.Event().wait(REPORT_EVERY_S)


def forward(port: int, socket_path: str) -> None:
    """Serve ``127.0.0.1:port`` by splicing each connection to the Unix socket ``socket_path`` (in threads)."""
    listener = socket.create_server(("127.0.0.1", port))

    def pipe(source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                target.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, target):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def accept() -> None:
        while True:
            client, _ = listener.accept()
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                upstream.connect(socket_path)
            except OSError:
                client.close()
                continue
            threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()

    threading.Thread(target=accept, name="proxy-forwarder", daemon=True).start()


def main() -> None:
    from opentinker.tracking import progress

    token = os.environ.pop("OPENTINKER_JOB_TOKEN")
    proxy = os.environ.get("OPENTINKER_JOB_PROXY")
    if proxy:
        from opentinker.server.job_proxy import PROXY_PORT

        forward(PROXY_PORT, proxy)
    progress.add_listener(ProgressReporter(os.environ["OPENTINKER_JOB_REPORT_URL"], token))
    run_flow_run(uuid.UUID(os.environ["PREFECT__FLOW_RUN_ID"]))


def run_flow_run(flow_run_id: uuid.UUID) -> None:
    """What ``python -m prefect.engine`` does (load the flow run and its flow, run it, exit as Prefect's engine
    exits), with the policy's training started first in its own process, as ``opentinker train`` starts it
    (``flows.train.run_train_flow``): loading the flow and its first steps (the MLflow run, the probe) then overlap
    training instead of coming first. The flow's training task adopts it; a Prefect retry trains anew from the last
    checkpoint."""
    from prefect._internal.control_listener import configure_from_env
    from prefect.engine import handle_engine_signals
    from prefect.flow_engine import flow_run_logger, load_flow, load_flow_run, run_flow

    configure_from_env()
    with handle_engine_signals(flow_run_id):
        flow_run = load_flow_run(flow_run_id=flow_run_id)
        parameters, early = dict(flow_run.parameters), None
        try:
            parameters["spec"], early = start_early(parameters["spec"])
        except Exception:  # a spec the flow itself will refuse, with its own message: it fails there
            pass
        logger = flow_run_logger(flow_run=flow_run)
        try:
            flow = load_flow(flow_run)
            run_flow(flow, flow_run=flow_run, parameters={**parameters, "early": early}, error_logger=logger)
        finally:
            if early is not None:
                early.cancel()  # the flow failed before its training task adopted it (else: nothing to do)


def start_early(spec: dict):
    """The resolved spec, and its training under way when it trains a policy in-process on a CPU (else None)."""
    from opentinker.agents.config import CONFIGS
    from opentinker.flows.presets import resolve_spec
    from opentinker.tasks.spec import RunSpec
    from opentinker.tasks.train import EarlyTraining

    resolved = resolve_spec(RunSpec.model_validate(spec))
    local = resolved.algorithm in CONFIGS and resolved.engine.backend == "local" and resolved.num_gpus == 0
    return resolved, EarlyTraining.start(resolved) if local else None


if __name__ == "__main__":
    main()
