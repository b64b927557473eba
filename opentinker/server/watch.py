"""A job on a terminal: one rich progress bar, the queue position while it waits, then training, until it ends.

Shared by ``opentinker submit`` and the SDK's trainers after ``connect()``. Interrupting the watch (Ctrl-C, a closed
laptop) leaves the job running on the server; ``opentinker jobs status|logs -f`` finds it again.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .client import Client


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
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console or Console(), transient=False) as bar:
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
