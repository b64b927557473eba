"""A run's plots drawn in a process of their own while the flow registers the model and runs the gate
(``flows.train.policy_run``).

Why a process: drawing is GIL-bound, so beside registration in a thread it gained nothing (3.1 s together against 3.2 s
one after the other), while by then the training child has exited and left its core free. The flow's process also
never imports matplotlib (0.4-0.7 s of a small run's start); the child does, while training ends.

Protocol, JSON lines: one request on the child's stdin (``history``: the history file, ``out``: the reports folder,
``eval_mean``, ``returns``, ``seed``: the evaluation, returns null without one), one answer on its stdout: ``paths``
(learning curve, dashboard metrics, then the evaluation's when there is one) or ``error`` (a traceback). End of input
without a request (the flow failed first) ends the child without drawing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any


class PlotProcess:
    """The flow's handle on a plotting child, started at once (it imports matplotlib meanwhile); a context manager
    that ends it, drawn or not, when the block exits."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def __enter__(self) -> PlotProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def draw(self, history: str | Path, out: str | Path, evaluation: Any | None) -> None:
        """Send the request; the child draws while this process goes on (``paths`` waits for it)."""
        request = {"history": str(history), "out": str(out), "eval_mean": None, "returns": None, "seed": None}
        if evaluation is not None:
            request.update(eval_mean=evaluation.mean, returns=list(evaluation.returns), seed=evaluation.seed)
        self._process.stdin.write(json.dumps(request) + "\n")
        self.close_input()

    def paths(self) -> list[str]:
        """The PNGs once drawn; raises with the child's traceback when drawing failed."""
        answer = json.loads(self._process.stdout.readline() or '{"error": "the plotting process exited"}')
        self.close()
        if "error" in answer:
            raise RuntimeError(f"plotting failed in its process (pid {self._process.pid}):\n{answer['error']}")
        return answer["paths"]

    def close_input(self) -> None:
        if not self._process.stdin.closed:
            self._process.stdin.close()

    def close(self) -> None:
        """End of input (the child exits, without drawing if asked nothing), then wait for it."""
        self.close_input()
        self._process.stdout.close()
        self._process.wait()


def draw_plots(
    history: list[dict[str, float]], out: Path, eval_mean: float | None, returns: list[float] | None, seed: int | None
) -> list[Path]:
    """The run's plots: learning curve, dashboard metrics, and the evaluation episode by episode when there is one."""
    from opentinker.tracking import plots

    paths = [
        plots.learning_curve(history, out / "learning_curve.png", eval_mean),
        plots.perf_metrics(history, out / "perf_metrics.png"),
    ]
    if returns is not None:
        paths.append(plots.evaluation_returns(returns, seed, out / "evaluation_returns.png"))
    return paths


def main() -> None:
    """The child: import matplotlib, wait for the request, draw, answer, exit at once (``os._exit``: the files are
    written and the answer flushed)."""
    from opentinker.tracking.plots import pyplot
    from opentinker.tracking.runs import load_history

    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints go to stderr, never into the answer
    pyplot()
    line = sys.stdin.readline()
    if not line:
        os._exit(0)
    try:
        request = json.loads(line)
        history = load_history(Path(request["history"]))
        drawn = draw_plots(history, Path(request["out"]), request["eval_mean"], request["returns"], request["seed"])
        reply: dict[str, Any] = {"paths": [str(path) for path in drawn]}
    except BaseException:
        reply = {"error": traceback.format_exc()}
    answer.write(json.dumps(reply) + "\n")
    answer.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
