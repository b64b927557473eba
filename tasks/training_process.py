"""Training in a child process that reports each iteration over a pipe: what ``opentinker train`` starts while
Prefect's server and the MLflow run are still starting (``tasks.train.EarlyTraining``), and, from the CLI
(``start_early``), before the flow's modules (Prefect, MLflow) are even imported: this module imports neither.

Where a warm process of the data dir listens (``tasks.fork_server``), the child is a fork of it (torch and the RL
core already imported: ~0.05 s to its first env step instead of ~2.5 s); else a fresh interpreter, and the first
run's end starts that warm process for the next.

Why a child process: the training loop is Python-bound, so as a thread beside a flow's start-up (Prefect's client, the
MLflow run, the probe) it ran at 60–80 % of its speed for its first hundreds of iterations; a child has its own
interpreter and core. The parent keeps the tracking: each iteration's metrics come back to its callback, and the
child exports the policy once the parent names the MLflow run. The child gets the run's spec as one JSON argument
(``RunSpec.model_dump_json``) and builds the trainer from its typed config.

Protocol, JSON lines. Child → parent (the child's stdout): ``{"step": int, "metrics": {...}}`` per iteration, then one
``{"done": {...}}`` or ``{"error": "traceback"}``. Parent → child (stdin): ``{"run_id": str}`` to export and finish,
the input kept open until the child has reported; its end before that (the parent cancelled, was interrupted, or
died) stops the child after its current iteration, with a checkpoint there and no export.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opentinker.infra.settings import get_settings
from opentinker.tasks import fork_server
from opentinker.tasks.spec import RunSpec

Callback = Callable[[dict[str, float], int], "bool | None"]


def run_dir(data_dir: Path, run_name: str) -> Path:
    """Checkpoints, export, history and reports of one named training run (the resume key)."""
    return data_dir / "runs" / run_name


def spec_dir(spec: RunSpec) -> Path:
    """The run directory of ``spec`` under the configured data dir."""
    return run_dir(get_settings().resolved_data_dir, spec.resolved_run_name)


def start_early(spec: RunSpec) -> TrainingProcess | None:
    """A child training ``spec`` (resolved) under its run directory, started now, when the spec can train ahead of
    its flow run (a policy algorithm, env copies in-process, CPU learner: no Ray resources to hold); else None.
    Whoever starts it hands it to ``flows.train.run_train_flow``, which adopts or cancels it."""
    from opentinker.agents.config import CONFIGS

    if spec.algorithm not in CONFIGS or spec.engine.backend != "local" or spec.num_gpus != 0:
        return None
    root = spec_dir(spec)
    root.mkdir(parents=True, exist_ok=True)
    return TrainingProcess(spec, root)


class TrainingProcess:
    """The parent's handle on a child training ``spec`` (env copies in its own process, CPU learner) under
    ``directory`` (checkpoints, export)."""

    def __init__(self, spec: RunSpec, directory: str | os.PathLike) -> None:
        argv = [__name__, spec.model_dump_json(), str(directory)]
        settings = get_settings()
        self._warm = settings.warm_process_idle_s > 0
        forked = fork_server.fork_child(settings.resolved_data_dir, argv) if self._warm else None
        self._process = forked or subprocess.Popen(
            [sys.executable, "-m", *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.forked = forked is not None
        self.pid = self._process.pid
        self._result: dict[str, Any] | None = None
        self._callback_error: BaseException | None = None
        self._reader: threading.Thread | None = None

    def report_to(self, on_iteration: Callback) -> None:
        """Start handing each iteration the child reports to ``on_iteration(metrics, step)`` (in a reader thread);
        a separate step so that the callback may depend on ``pid``."""
        self._reader = threading.Thread(
            target=self._read, args=(on_iteration,), name="opentinker-training", daemon=True
        )
        self._reader.start()

    def _read(self, on_iteration: Callback) -> None:
        for line in self._process.stdout:
            message = json.loads(line)
            if "step" not in message:
                self._result = message
            elif self._callback_error is None:  # a failing callback fails the stage; the pipe is still drained
                try:
                    on_iteration(message["metrics"], message["step"])
                except BaseException as exc:
                    self._callback_error = exc

    def finish(self, run_id: str) -> dict[str, Any]:
        """Name the MLflow run, wait for the loop and the export: ``start_step``, ``global_step``, ``seconds``,
        ``export_dir``, ``checkpoint_path``. Raises with the child's traceback when it failed. Interrupted (Ctrl-C
        in this process), it stops the child as ``cancel`` does before the interrupt goes on."""
        if self._reader is None:
            self.report_to(lambda metrics, step: None)
        try:
            with contextlib.suppress(BrokenPipeError, ValueError):  # the child already exited: its result says why
                self._process.stdin.write(json.dumps({"run_id": run_id}) + "\n")
                self._process.stdin.flush()
            self._reader.join()  # until the child has reported and exited
        finally:
            self._close()
        if self._warm and not self.forked:  # the next run's child forks from a warm process (``fork_server``)
            settings = get_settings()
            fork_server.start_server(settings.resolved_data_dir, settings.warm_process_idle_s)
        if self._callback_error is not None:
            raise self._callback_error
        if self._result is None or "done" not in self._result:
            error = (self._result or {}).get("error", f"the training process exited with {self._process.returncode}")
            raise RuntimeError(f"training failed in its process (pid {self.pid}):\n{error}")
        return self._result["done"]

    def cancel(self) -> None:
        """Stop the child after its current iteration (it checkpoints there) and wait for it; nothing once it has
        finished."""
        self._close()

    def _close(self) -> None:
        """Close the child's input (a child still training stops: ``_child``), drain its output, wait for it to
        exit."""
        if not self._process.stdin.closed:
            self._process.stdin.close()
        if self._reader is None:
            self.report_to(lambda metrics, step: None)
        self._reader.join()
        self._process.wait()


def warm_up() -> None:
    """What a training child imports before its first env step, loaded once by the data dir's warm training process
    (``fork_server.TRAINING``); torch._dynamo is the first optimiser's import."""
    import gymnasium  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401

    import opentinker.agents.build
    import opentinker.agents.export  # noqa: F401


def _child(spec: RunSpec, directory: str, report: Any) -> None:
    """The child's whole life: build, train while the parent's input stays open, wait for the run's id, export,
    report. The parent's input closing (``TrainingProcess.cancel``, or the parent gone) stops the loop after its
    iteration, whether or not the run was named: a Ctrl-C of the flow stops its training."""
    from opentinker.agents.build import build_trainer, env_copies, run_loop
    from opentinker.agents.checkpoint import CHECKPOINT_NAME
    from opentinker.agents.export import export_policy

    answer: dict[str, Any] = {}
    answered, closed = threading.Event(), threading.Event()

    def listen() -> None:
        for line in sys.stdin:
            answer.update(json.loads(line))
            answered.set()
        closed.set()
        answered.set()  # nothing more comes

    threading.Thread(target=listen, daemon=True).start()

    def send(metrics: dict[str, float], step: int) -> bool:
        report.write(json.dumps({"step": int(step), "metrics": {k: float(v) for k, v in metrics.items()}}) + "\n")
        return not closed.is_set()

    root = Path(directory)
    config = spec.engine.config()
    env = env_copies(spec.env_id, spec.seed, config, validate=False)  # the flow's probe validates it
    try:
        trainer = build_trainer(env, spec.algorithm, config, spec.seed, root, "cpu", spec.resume)
        start_step = int(trainer.global_step)
        seconds = run_loop(trainer, spec.steps, root, spec.checkpoint_every, send)
        answered.wait()
        if closed.is_set():  # cancelled
            return
        metadata = {"env_id": spec.env_id, "run_id": answer["run_id"]}
        export_dir = export_policy(trainer, root / "export", metadata=metadata)
    finally:
        env.close()
    done = {"start_step": start_step, "global_step": int(trainer.global_step), "seconds": seconds}
    done["checkpoint_path"] = str(root / "checkpoints" / CHECKPOINT_NAME)  # the parent need not import torch for it
    report.write(json.dumps({"done": {**done, "export_dir": str(export_dir)}}) + "\n")


def main(argv: list[str]) -> None:
    """Run the child, then exit at once like a multiprocessing child (``os._exit``): everything it made is written
    and reported, and the interpreter's teardown (torch's included) would only delay the parent's wrap-up. A
    terminal's Ctrl-C reaches the whole process group; the child leaves it to its parent, which closes its input
    (``_child``: it stops after the iteration, checkpointed, instead of dying mid-way)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    report = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints (libraries, warnings) go to stderr, never into the protocol
    code = 0
    try:
        _child(RunSpec.model_validate_json(argv[1]), argv[2], report)
    except BaseException:
        report.write(json.dumps({"error": traceback.format_exc()}) + "\n")
        code = 1
    report.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv)
