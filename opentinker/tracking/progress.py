"""A process-local hook through which the training stage reports progress to whoever shows it (the CLI's rich bar).

Flow parameters must stay serialisable, so a live callback cannot travel as one; the CLI registers a
listener here before running the flow, and the training task reports each iteration to it.
"""

from __future__ import annotations

from collections.abc import Callable

Listener = Callable[[int, int, dict[str, float]], None]
"""listener(global_step, total_steps, metrics)"""

_listeners: list[Listener] = []


def add_listener(listener: Listener) -> None:
    _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def report(step: int, total: int, metrics: dict[str, float]) -> None:
    for listener in list(_listeners):
        listener(step, total, metrics)
