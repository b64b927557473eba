"""Inside a job's sandbox: report training progress to the server, then run the flow run as Prefect's engine does.

The worker starts ``python -m opentinker.server.job_entry`` with ``PREFECT__FLOW_RUN_ID`` and the attempt's token
(``OPENTINKER_JOB_TOKEN``) in an environment that holds nothing else of the server's. Progress goes out at most twice
a second from a background thread, so a slow server never slows training; a report that fails is dropped (the next
one carries the newer figures).
"""

from __future__ import annotations

import json
import os
import runpy
import threading
import urllib.request

REPORT_EVERY_S = 0.5


class ProgressReporter:
    """A ``tracking.progress`` listener that posts the latest (step, total, metrics) to the server."""

    def __init__(self, url: str, job_id: str, token: str):
        self.url = f"{url.rstrip('/')}/v1/internal/jobs/{job_id}/progress"
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


def main() -> None:
    from opentinker.tracking import progress

    token = os.environ.pop("OPENTINKER_JOB_TOKEN")
    progress.add_listener(
        ProgressReporter(os.environ["OPENTINKER_JOB_REPORT_URL"], os.environ["OPENTINKER_JOB_ID"], token)
    )
    runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
