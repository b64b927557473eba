"""One attempt of a server job, on the trusted side of the boundary: the Prefect flow run a worker starts.

The worker runs this flow run as an ordinary process (``python -m opentinker.server.attempt``), with the attempt's
launch from the server (``launches.py``) in its environment. The flow opens the job's MLflow run in the tenant's
store, starts the tenant's code as a sandboxed child (``job_child.py``: bubblewrap, a cgroup with the tenant's
limits, a fresh scratch folder, one end of a private socket pair) and reads what the child sends (``channel.py``):
metrics go to the MLflow run and the job's progress, checkpoints and exports into the job's run folder (which no
sandbox can write), the result's numbers into the gate. Then trusted code registers the model from the validated
export, moves the aliases, renders the reports and reports the typed result to the server, the one writer of the
job record. Prefect sees an ordinary flow run (states, retries, logs); the sandbox never talks to it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from .channel import GroupResult, PolicyResult
from .finish import copy_champion, finish_group, finish_grpo, finish_policy
from .sandboxed import ChildFailed, SandboxedChild
from .schemas import JobResult, LaunchInfo

LAUNCH_VARIABLE = "OPENTINKER_LAUNCH"
REPORT_EVERY_S = 0.5
RETRIES = 2
"""Children started again within an attempt after one failed (each resumes from the last checkpoint sent)."""


class Reporter:
    """Posts the attempt's progress (at most every ``REPORT_EVERY_S``, from a thread: a slow server never slows the
    attempt) and its result to the server, with the attempt's token."""

    def __init__(self, server_url: str, job_id: str, token: str):
        self.base = f"{server_url.rstrip('/')}/v1/internal/jobs/{job_id}"
        self.token = token
        self._latest: dict | None = None
        self._wake = threading.Event()
        threading.Thread(target=self._send_loop, name="progress", daemon=True).start()

    def __call__(self, step: int, total: int, metrics: dict[str, float]) -> None:
        wanted = ("charts/sps", "charts/episodic_return_mean")
        self._latest = {
            "step": int(step),
            "total": int(total),
            "metrics": {k: metrics[k] for k in wanted if k in metrics},
        }
        self._wake.set()

    def _post(self, path: str, body: dict, timeout: float) -> None:
        request = urllib.request.Request(
            f"{self.base}/{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.token}"},
        )
        urllib.request.urlopen(request, timeout=timeout).close()

    def _send_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            body, self._latest = self._latest, None
            if body is not None:
                try:
                    self._post("progress", body, 5)
                except OSError:
                    pass  # the next report carries newer figures
                time.sleep(REPORT_EVERY_S)

    def result(self, result: JobResult) -> None:
        """The job's result: retried while the server is away (it is what the job record will say)."""
        for delay in (1, 2, 4, 8, 15, 30, 60):
            try:
                return self._post("result", result.model_dump(), 30)
            except urllib.error.HTTPError as exc:
                if exc.code < 500:  # refused (not this job's attempt any more, or not a valid result): final
                    raise
                time.sleep(delay)
            except OSError:
                time.sleep(delay)
        self._post("result", result.model_dump(), 30)


def current_launch() -> LaunchInfo:
    return LaunchInfo.model_validate_json(os.environ[LAUNCH_VARIABLE])


@flow(name="train", log_prints=True)
def job_attempt(job_id: str) -> JobResult:
    """One attempt of job ``job_id``: the tenant's code in its sandbox, everything it reports written here. A child
    that fails is started again from the last checkpoint it sent, up to ``RETRIES`` times (this loop is the flow's one
    retry layer: a Prefect flow retry would also retry a limit hit); a limit hit fails the attempt at once."""
    from opentinker.tasks.run import tracked_run
    from opentinker.tracking import progress
    from opentinker.tracking.runs import MetricsLogger

    launch = current_launch()
    if launch.job_id != job_id:
        raise ValueError(f"job_id: this flow run's launch is for job {launch.job_id}, not {job_id}")
    spec = launch.spec
    if not spec.resolved:  # resolving may import the tenant's env: only a sandbox does (the env check, at submit)
        raise ValueError("spec: not resolved at submit (a job stored by an older server): submit it again")
    job_dir = Path(launch.job_dir)
    reporter = Reporter(launch.server_url, launch.job_id, launch.token)
    progress.add_listener(reporter)
    champion_root = _ahead.pop("champion_root", None) or Path(tempfile.mkdtemp(prefix="champion-"))
    log = get_run_logger()
    child = _ahead.pop("child", None)
    try:
        champion, champion_dir = copy_champion(spec, champion_root)

        def start(ahead: SandboxedChild | None = None) -> SandboxedChild:
            child = ahead or SandboxedChild(launch, job_dir, champion_root, log)
            child.log = log
            child.start(spec, champion_dir)
            return child

        child = start(child)
        total = spec.budget
        logger = MetricsLogger.with_progress(None, total, system=False)  # the child reports its own perf/
        with tracked_run(spec.config_form(), spec.resolved_run_name, spec.experiment) as run:
            logger.run_id = run.run_id
            for retry in range(RETRIES + 1):
                try:
                    result = child.pump(job_dir, logger)
                    break
                except ChildFailed as exc:
                    if retry == RETRIES:
                        raise
                    log.warning("the job failed (%s); starting it again from its last checkpoint", str(exc)[:300])
                finally:
                    child.close()
                    logger.flush()
                child = start()
            if isinstance(result, PolicyResult):
                outcome = finish_policy(spec, run, result, job_dir, logger, champion)
            elif isinstance(result, GroupResult):
                outcome = finish_group(spec, run, result, job_dir)
            else:
                outcome = finish_grpo(spec, run, result, job_dir, champion)
        reporter.result(outcome)
        return outcome
    finally:
        progress.remove_listener(reporter)
        if child is not None:
            child.close()
        shutil.rmtree(champion_root, ignore_errors=True)


_ahead: dict[str, Any] = {}
"""The attempt's first child and its champion folder, started by ``main`` ahead of the flow run: the child's start-up
(a sandbox, an interpreter importing torch and the env) overlaps Prefect's, and it waits for its ``Start``."""


def main() -> None:
    """Start the attempt's first child, then run the worker's flow run (``job_attempt``), which adopts it."""
    import uuid

    from .prefect_private import run_flow_run

    launch = current_launch()
    Path(launch.job_dir).mkdir(parents=True, exist_ok=True)
    _ahead["champion_root"] = Path(tempfile.mkdtemp(prefix="champion-"))
    _ahead["child"] = SandboxedChild(
        launch, Path(launch.job_dir), _ahead["champion_root"], logging.getLogger("opentinker.attempt")
    )
    run_flow_run(job_attempt, uuid.UUID(os.environ["PREFECT__FLOW_RUN_ID"]))


if __name__ == "__main__":
    main()
