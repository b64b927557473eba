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
import runpy
import socket
import threading
import urllib.request

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
    runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
