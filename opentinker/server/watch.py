"""A job on a terminal: one rich progress bar, the queue position while it waits, then training, until it ends.

Shared by ``opentinker submit`` and the SDK's trainers after ``connect()``. Interrupting the watch (Ctrl-C, a closed
laptop) leaves the job running on the server; ``opentinker jobs status|logs -f`` finds it again.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .client import Client


def steps_bar(console: Console | None = None, time_left: bool = False) -> Progress:
    """The rich bar a run of training steps shows (a job here, a local run in the CLI): its name, steps done of the
    total, an ``info`` field, the time taken and, with ``time_left``, rich's estimate of the time left."""
    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    ]
    if time_left:
        columns.append(TimeRemainingColumn())
    return Progress(*columns, console=console or Console(), transient=False)


def describe(job: dict[str, Any]) -> str:
    """One line for the job's state: where it is in the queue, or how training goes."""
    state, queue, progress = job["state"], job.get("queue"), job.get("progress")
    if state == "QUEUED" and queue:
        return f"queued: {queue['position']} of {queue['queued']} · waiting for {queue['waiting_for']}"
    if state == "RUNNING" and progress:
        parts = [progress["phase"]]
        if progress.get("steps_per_s"):
            parts.append(f"{progress['steps_per_s']:,.0f} steps/s")
        if progress.get("mean_return") is not None:
            parts.append(f"return {progress['mean_return']:.1f}")
        if progress.get("eta_s") is not None and progress["phase"] == "training":
            parts.append(f"ETA {progress['eta_s']:.0f} s")
        return " · ".join(parts)
    return state.lower() + (f": {job['reason']}" if job.get("reason") else "")


def follow(client: Client, job: dict[str, Any], console: Console | None = None) -> dict[str, Any]:
    """Show the job's progress until it ends; returns its final status."""
    with steps_bar(console) as bar:
        task = bar.add_task(f"{job['id']} {job['algorithm'].upper()} {job['env_id']}", total=job["steps"], info="")

        def update(status: dict[str, Any]) -> None:
            progress = status.get("progress") or {}
            bar.update(task, completed=progress.get("step", 0), total=status["steps"], info=describe(status))

        update(job)
        final = client.wait(job["id"], on_update=update)
        if final["state"] == "SUCCEEDED":
            bar.update(task, completed=final["steps"])
        bar.update(task, info=describe(final))
    return final
