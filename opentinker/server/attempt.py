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
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from opentinker.infra.files import atomic_write
from opentinker.infra.settings import get_settings

from .channel import (
    Channel,
    ChannelError,
    Failure,
    FileBegin,
    GroupResult,
    GRPOResult,
    Log,
    Metrics,
    PolicyResult,
    Result,
    Start,
    evaluation_result,
    safe_relative,
)
from .schemas import JobResult, KindResult, LaunchInfo

LAUNCH_VARIABLE = "OPENTINKER_LAUNCH"
SCRATCH_ROOT_VARIABLE = "OPENTINKER_SCRATCH_ROOT"
"""Where the worker keeps its attempts' scratch folders (outside every tenant's folder)."""
CHILD = ("-m", "opentinker.server.job_child")
SCRATCH = Path("/job")
"""The attempt's scratch folder inside the sandbox: its data dir, the only place it can write (besides /tmp)."""
CODE = Path("/code")
"""Where the sandbox sees the tenant's uploaded code (read-only)."""
MAX_FILE = 4 << 30
MAX_FILES = 16 << 30
MAX_OUTPUT_LINES = 5000
REPORT_EVERY_S = 0.5
LIMITS_POLL_S = 0.5
RETRIES = 2
"""Children started again within an attempt after one failed (each resumes from the last checkpoint sent)."""


class ChildFailed(RuntimeError):
    """The child ended without a result (its own error, a broken protocol, a killed process): worth one more try."""


class LimitExceeded(RuntimeError):
    """The child hit a limit of its cgroup (memory, processes): retrying would hit it again."""


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


class SandboxedChild:
    """The attempt's sandboxed child: a fresh scratch folder, a cgroup, the channel's other end, its process."""

    def __init__(
        self, launch: LaunchInfo, job_dir: Path, champion_dir: Path | None, log: Any, command: tuple[str, ...] = CHILD
    ):
        from .sandbox import Sandbox, base_env

        self.log = log
        self._lines = 0
        self._closed = False
        settings = get_settings()
        root = Path(os.environ.get(SCRATCH_ROOT_VARIABLE) or tempfile.gettempdir())
        self.scratch = Path(tempfile.mkdtemp(prefix="attempt-", dir=root))
        previous = job_dir / "checkpoints"
        if previous.is_dir():  # resume: a copy of the last checkpoint the job sent (the job's folder stays trusted)
            shutil.copytree(previous, self.scratch / "runs" / launch.job_id / "checkpoints")
        self.channel, theirs = (Channel(end) for end in socket.socketpair())
        self.cgroup = _cgroup(launch)
        sandboxed = settings.sandbox == "bwrap"
        env = {**launch.env, "OPENTINKER_JOB_ID": launch.job_id, "OPENTINKER_CHANNEL_FD": str(theirs.sock.fileno())}
        fds = [theirs.sock.fileno()]
        if sandboxed:
            from opentinker.infra.bwrap import pipe_with, seccomp_program

            readonly = [Path(p) for p in launch.readonly] + ([champion_dir] if champion_dir else [])
            code = ((Path(launch.code), CODE),) if launch.code else ()
            box = Sandbox(
                readonly=tuple(readonly),
                readonly_at=code,
                binds=((self.scratch, SCRATCH),),
                env={**env, "OPENTINKER_DATA_DIR": str(SCRATCH), **({"PYTHONPATH": str(CODE)} if code else {})},
                network=not launch.isolated,
            )
            seccomp = pipe_with(seccomp_program())
            fds.append(seccomp)
            argv, process_env = box.argv([sys.executable, *command], seccomp_fd=seccomp), {}
        else:  # OPENTINKER_SANDBOX=none: trusted tenants only (docs/service.md); the same channel, no namespaces
            argv = [sys.executable, *command]
            process_env = {**base_env(), **env, "OPENTINKER_DATA_DIR": str(self.scratch)}
            if launch.code:
                process_env["PYTHONPATH"] = launch.code
        if self.cgroup is not None:
            argv = self.cgroup.wrap(argv)
        self.process = subprocess.Popen(
            argv, pass_fds=fds, env=process_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for fd in fds[1:]:
            os.close(fd)
        theirs.close()
        self._output = threading.Thread(target=self._log_output, name="child-output", daemon=True)
        self._output.start()
        if self.cgroup is not None:
            threading.Thread(target=self._watch_limits, name="child-limits", daemon=True).start()

    def _watch_limits(self) -> None:
        """End the whole child as soon as it hits a limit: an out-of-memory kill takes only the largest process
        (cgroup v1), and what is left of the job would otherwise hang on it."""
        while self.process.poll() is None:
            if self.cgroup.limit_hit():
                self.cgroup.kill()
                return
            time.sleep(LIMITS_POLL_S)

    def _log_output(self) -> None:
        """The child's own output (prints, warnings, tracebacks) into the flow run's log, line by bounded line."""
        while line := self.process.stdout.readline(2000):
            self._log_line(line.decode(errors="replace").rstrip())

    def _log_line(self, line: str) -> None:
        """One line of the job's into the flow run's log, at most ``MAX_OUTPUT_LINES`` per child (output and ``log``
        messages together): a chatty job cannot fill Prefect's log store."""
        self._lines += 1
        if self._lines <= MAX_OUTPUT_LINES:
            self.log.info("job: %s", line)
        elif self._lines == MAX_OUTPUT_LINES + 1:
            self.log.warning("job: more output than %d lines; the rest is left out", MAX_OUTPUT_LINES)

    def start(self, spec: dict[str, Any], champion_dir: Path | None) -> None:
        self.channel.send(Start(spec=spec, champion_dir=str(champion_dir) if champion_dir else None))

    def pump(self, job_dir: Path, on_metrics: Any) -> Result:
        """Read the child's messages until it ends; files land in ``job_dir``. The result, or an error naming why
        there is none (the child's failure, a limit, a broken protocol)."""
        result: Result | None = None
        failure = ""
        try:
            for message in self.channel.messages(MAX_FILE, MAX_FILES):
                if isinstance(message, tuple):
                    _store(job_dir, *message)
                elif isinstance(message, Metrics):
                    on_metrics(dict(message.values), message.step)
                elif isinstance(message, Log):
                    self._log_line(message.line)
                elif isinstance(message, Failure):
                    failure = message.error
                elif result is None:
                    result = message
        except ChannelError as exc:
            failure = str(exc)
            self.kill()
        except OSError:
            pass
        finally:
            self.channel.close()
        code = self.wait()
        limit = self.cgroup.limit_hit() if self.cgroup is not None else None
        if limit:
            raise LimitExceeded(limit)
        if result is None:
            last = failure.strip().splitlines()[-1] if failure.strip() else f"the job's process exited with {code}"
            raise ChildFailed(f"{last[:500]}\n{failure[-4000:]}" if failure else last)
        return result

    def wait(self) -> int:
        try:
            return self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.process.wait()

    def kill(self) -> None:
        if self.cgroup is not None:
            self.cgroup.kill()
        if self.process.poll() is None:
            self.process.kill()

    def close(self) -> None:
        """End the child (every process of its cgroup), remove its cgroup and scratch folder; once."""
        if self._closed:
            return
        self._closed = True
        self.kill()
        self.process.wait()
        self._output.join(timeout=5)
        if self.cgroup is not None:
            self.cgroup.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def _cgroup(launch: LaunchInfo) -> Any:
    """The attempt's cgroup with the tenant's limits, or None where limits are turned off (``job_limits = none``).
    Named after the job: one attempt of a job runs at a time, and the next finds a crashed one's cgroup and removes
    it."""
    from opentinker.infra.cgroups import JobLimits, job_cgroup

    return job_cgroup(launch.job_id, JobLimits(**launch.limits))


def _store(job_dir: Path, begin: FileBegin, chunks: Any) -> None:
    """A file the job sends, streamed by trusted code into the job's run folder (no sandbox can write there): a temp
    file renamed into place once its bytes and checksum are in, removed otherwise."""

    def write(handle: Any) -> None:
        for chunk in chunks:
            handle.write(chunk)

    atomic_write(job_dir / safe_relative(begin.path), write)


def _champion(spec: Any, into: Path) -> tuple[Any, Path | None]:
    """The current champion of the job's model, its files copied into ``into`` (bound read-only into the child's
    sandbox) for the child to evaluate; (None, None) when there is none yet."""
    from opentinker.tasks.register import CHAMPION, find_model_version

    if spec.algorithm == "group":
        return None, None
    if spec.algorithm == "grpo":
        from opentinker.tracking.llm_store import download_adapter
        from opentinker.tracking.registry import PolicyStoreError

        try:
            ref, folder = download_adapter(f"models:/{spec.resolved_model_name}@{CHAMPION}")
        except PolicyStoreError:
            return None, None
        shutil.copytree(folder, into, dirs_exist_ok=True)
        return ref, into
    from opentinker.tracking.registry import download_policy

    ref = find_model_version.fn(spec.resolved_model_name, CHAMPION)
    if ref is None:
        return None, None
    shutil.copytree(download_policy(ref), into, dirs_exist_ok=True)
    return ref, into


def _validated_export(directory: Path, run_id: str) -> None:
    """Load the job's export as data (JSON, ``np.load`` without pickle) before anything registers it, and stamp
    the MLflow run into its metadata."""
    from opentinker.tracking.registry import load_registered_policy

    spec_path = directory / "policy.json"
    if not spec_path.is_file() or spec_path.stat().st_size > 1 << 20:
        raise ChannelError("export: expected policy.json of at most 1 MiB")
    load_registered_policy(directory)  # refuses what is not the project's numpy export
    spec = json.loads(spec_path.read_text())
    spec["metadata"] = {**(spec.get("metadata") or {}), "run_id": run_id}
    atomic_write(spec_path, json.dumps(spec))


def finish_policy(spec: Any, run: Any, result: PolicyResult, job_dir: Path, logger: Any, champion: Any) -> JobResult:
    """Register the validated export as ``candidate``, apply the gate to the numbers the child measured, reports."""
    from opentinker.flows.train import publish_policy
    from opentinker.tasks.register import promote_if_better, register_model
    from opentinker.tasks.types import TrainOutcome

    export_dir = job_dir / "export"
    _validated_export(export_dir, run.run_id)
    evaluation = evaluation_result(result.evaluation, f"run/{run.run_id}")
    candidate = register_model(
        run.run_id, str(export_dir), spec.resolved_model_name, evaluation, step=result.global_step
    )
    champion_eval = random_eval = None
    if champion is not None and result.champion_evaluation is not None:
        champion_eval = evaluation_result(result.champion_evaluation, champion.key)
    if result.random_evaluation is not None:
        random_eval = evaluation_result(result.random_evaluation, f"random/{spec.env_id}")
    if champion is not None and champion_eval is None:
        champion = None  # the child could not evaluate it: the gate then judges the candidate alone
    released = promote_if_better(candidate, evaluation, champion, champion_eval, result.threshold, random_eval)
    trained = TrainOutcome(
        run_id=run.run_id,
        checkpoint_path=str(job_dir / "checkpoints" / "checkpoint.pt"),
        export_dir=str(export_dir),
        history_path=str(logger.save_history(job_dir / "history.jsonl")),
        start_step=result.start_step,
        global_step=result.global_step,
        iterations=len(logger.history),
        train_seconds=result.train_seconds,
    )
    publish_policy(spec, run, trained, evaluation, released, candidate.model_id)
    return JobResult(
        kind="policy",
        run_id=run.run_id,
        experiment_id=run.tracking.experiment_id,
        model_name=released.name,
        model_version=released.version,
        aliases=released.aliases,
        decision=released.decision,
        eval_mean=evaluation.mean,
        eval_std=evaluation.std,
        global_step=result.global_step,
    )


def finish_group(spec: Any, run: Any, result: GroupResult, job_dir: Path) -> JobResult:
    """One registered model per agent kind, from its validated export."""
    from opentinker.tasks.register import register_model

    kinds = {}
    for kind, reported in result.evaluations.items():
        export_dir = job_dir / "exports" / kind
        _validated_export(export_dir, run.run_id)
        evaluation = evaluation_result(reported, f"{run.run_id}/{kind}")
        name = f"{spec.resolved_model_name}-{kind}"
        ref = register_model(run.run_id, str(export_dir), name, evaluation, step=result.global_step)
        kinds[kind] = KindResult(
            model_name=name, model_version=ref.version, eval_mean=evaluation.mean, eval_std=evaluation.std
        )
    run.summarise(
        metrics={f"eval/{kind}/mean": k.eval_mean for kind, k in kinds.items()},
        step=result.global_step,
        tags={f"opentinker.model.{kind}": f"{k.model_name}/{k.model_version}" for kind, k in kinds.items()},
    )
    return JobResult(
        kind="group",
        run_id=run.run_id,
        experiment_id=run.tracking.experiment_id,
        model_name=spec.resolved_model_name,
        model_version="",
        aliases=["candidate"],
        decision="registered one model per agent kind (no gate)",
        global_step=result.global_step,
        kinds=kinds,
    )


ADAPTER_FILES = {
    "adapter_model.safetensors",
    "adapter_config.json",
    "opentinker_llm.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
}


def _validated_adapter(directory: Path) -> None:
    """Only the adapter's data files (safetensors, JSON, text) stay; JSON must parse, safetensors must load, and a
    tokenizer config may name no code to import (``auto_map``)."""
    from safetensors import safe_open

    for path in directory.iterdir():
        if path.name not in ADAPTER_FILES:
            path.unlink()
        elif path.suffix == ".json":
            data = json.loads(path.read_text())
            if isinstance(data, dict) and data.pop("auto_map", None) is not None:
                atomic_write(path, json.dumps(data))
    with safe_open(str(directory / "adapter_model.safetensors"), framework="pt"):
        pass


def finish_grpo(spec: Any, run: Any, result: GRPOResult, job_dir: Path, champion: Any) -> JobResult:
    """Register the validated adapter as ``candidate``; the gate compares the held-out success the child measured
    for it and for the champion on the same prompts."""
    from opentinker.flows.grpo import summarise_adapter
    from opentinker.tasks.llm import LLMEvaluation, decide_adapter, register_adapter

    adapter_dir = job_dir / "adapter"
    _validated_adapter(adapter_dir)
    config = spec.engine.config(task=spec.env_id)
    version = register_adapter.fn(
        run.run_id, str(adapter_dir), spec.resolved_model_name, config.base_model, spec.env_id
    )
    candidate = LLMEvaluation(**result.evaluation.model_dump())
    champion_success = result.champion_success if champion is not None and champion.version != version else None
    gate = decide_adapter(
        spec.resolved_model_name, version, candidate, champion, champion_success, spec.champion_threshold or 0.0
    )
    summarise_adapter(run, gate, config.base_model, candidate, result.completions_per_s, result.updates)
    return JobResult(
        kind="grpo",
        run_id=run.run_id,
        experiment_id=run.tracking.experiment_id,
        model_name=spec.resolved_model_name,
        model_version=version,
        aliases=gate.aliases,
        decision=gate.decision,
        heldout_success=candidate.success,
        global_step=result.updates,
    )


def current_launch() -> LaunchInfo:
    return LaunchInfo.model_validate_json(os.environ[LAUNCH_VARIABLE])


@flow(name="train", log_prints=True)
def job_attempt(job_id: str) -> JobResult:
    """One attempt of job ``job_id``: the tenant's code in its sandbox, everything it reports written here. A child
    that fails is started again from the last checkpoint it sent, up to ``RETRIES`` times (this loop is the flow's one
    retry layer: a Prefect flow retry would also retry a limit hit); a limit hit fails the attempt at once."""
    from opentinker.tasks.run import tracked_run
    from opentinker.tasks.spec import RunSpec
    from opentinker.tracking import progress
    from opentinker.tracking.runs import MetricsLogger

    launch = current_launch()
    if launch.job_id != job_id:
        raise ValueError(f"job_id: this flow run's launch is for job {launch.job_id}, not {job_id}")
    spec = RunSpec.model_validate(launch.spec)
    if not spec.resolved:  # resolving may import the tenant's env: only a sandbox does (the env check, at submit)
        raise ValueError("spec: not resolved at submit (a job stored by an older server): submit it again")
    job_dir = Path(launch.job_dir)
    reporter = Reporter(launch.server_url, launch.job_id, launch.token)
    progress.add_listener(reporter)
    champion_root = _ahead.pop("champion_root", None) or Path(tempfile.mkdtemp(prefix="champion-"))
    log = get_run_logger()
    child = _ahead.pop("child", None)
    try:
        champion, champion_dir = _champion(spec, champion_root)

        def start(ahead: SandboxedChild | None = None) -> SandboxedChild:
            child = ahead or SandboxedChild(launch, job_dir, champion_root, log)
            child.log = log
            child.start(launch.spec, champion_dir)
            return child

        child = start(child)
        total = spec.engine.updates if spec.algorithm == "grpo" else spec.steps
        logger = MetricsLogger.with_progress(None, total)
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
    """What ``python -m prefect.engine`` does for the worker's flow run (load it, run ``job_attempt``)."""
    import uuid

    from prefect._internal.control_listener import configure_from_env
    from prefect.engine import handle_engine_signals
    from prefect.flow_engine import flow_run_logger, load_flow_run, run_flow

    launch = current_launch()
    Path(launch.job_dir).mkdir(parents=True, exist_ok=True)
    _ahead["champion_root"] = Path(tempfile.mkdtemp(prefix="champion-"))
    _ahead["child"] = SandboxedChild(
        launch, Path(launch.job_dir), _ahead["champion_root"], logging.getLogger("opentinker.attempt")
    )
    configure_from_env()
    flow_run_id = uuid.UUID(os.environ["PREFECT__FLOW_RUN_ID"])
    with handle_engine_signals(flow_run_id):
        flow_run = load_flow_run(flow_run_id=flow_run_id)
        run_flow(
            job_attempt,
            flow_run=flow_run,
            parameters=dict(flow_run.parameters),
            error_logger=flow_run_logger(flow_run=flow_run),
        )


if __name__ == "__main__":
    main()
