"""``@remote``: run a function (or an env method) as a Ray task, queued by priority.

Priority is real: calls wait in a process-wide priority queue and are submitted to Ray only while fewer tasks
are in flight than the cluster has CPUs, highest priority first (then first come, first served). So a
``priority="high"`` evaluation submitted behind a hundred ``"low"`` rollouts starts at the next free slot.
Ray's own scheduler has no task priorities; this queue is where they live.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import heapq
import itertools
import site
import sys
import sysconfig
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

PRIORITIES = {"low": 0, "normal": 1, "high": 2}


def workers_can_import(module_name: str) -> bool:
    """True for OpenTinker and installed packages; False for ``__main__``, scripts, notebooks and test files, which
    a Ray worker (another process, maybe another machine) cannot import."""
    module = sys.modules.get(module_name)
    if module_name == "__main__" or module is None:
        return False
    if module_name.split(".")[0] == "opentinker":
        return True
    file = getattr(module, "__file__", None)
    roots = {*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"]}
    return file is None or any(Path(file).resolve().is_relative_to(Path(root).resolve()) for root in roots)


def ship_by_value(module_name: str, pickler: ModuleType) -> None:
    """Make ``pickler`` (cloudpickle or ``ray.cloudpickle``) pickle the classes and functions of ``module_name``
    by value (their code travels with them) when workers could not import it; ``__main__`` already is."""
    if module_name != "__main__" and not workers_can_import(module_name):
        pickler.register_pickle_by_value(sys.modules[module_name])


def _priority_value(priority: str | int) -> int:
    if isinstance(priority, int) and not isinstance(priority, bool):
        return priority
    if priority in PRIORITIES:
        return PRIORITIES[priority]
    raise ValueError(f"remote priority must be an int or one of {sorted(PRIORITIES)}, got {priority!r}")


class _PriorityDispatcher:
    """Holds pending calls in a heap; a daemon thread submits them to Ray as slots free up."""

    def __init__(self) -> None:
        self._heap: list = []
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._inflight: dict = {}
        self._thread: threading.Thread | None = None

    def submit(self, task, args: tuple, kwargs: dict, priority: int) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            heapq.heappush(self._heap, (-priority, next(self._order), task, args, kwargs, future))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="opentinker-remote-dispatch", daemon=True)
                self._thread.start()
            self._wake.notify()
        return future

    def _capacity(self) -> int:
        import ray

        return max(1, int(ray.cluster_resources().get("CPU", 1)))

    def _run(self) -> None:
        import ray

        capacity = self._capacity()
        while True:
            with self._wake:
                while self._heap and len(self._inflight) < capacity:
                    _, _, task, args, kwargs, future = heapq.heappop(self._heap)
                    self._inflight[task.remote(*args, **kwargs)] = future
                if not self._inflight:
                    if not self._wake.wait(timeout=30.0) and not self._heap:
                        self._thread = None
                        return
                    continue
            ready, _ = ray.wait(list(self._inflight), num_returns=1, timeout=0.05)
            for ref in ready:
                future = self._inflight.pop(ref)
                try:
                    future.set_result(ray.get(ref))
                except Exception as exc:  # the task's own error, re-raised to the caller
                    future.set_exception(exc)


_DISPATCHER = _PriorityDispatcher()


class RemoteFunction:
    """A function that runs as a Ray task: ``f(...)`` blocks for the value, ``f.remote_call(...)`` returns a
    ``concurrent.futures.Future``, ``await f.async_call(...)`` suits asyncio code, ``f.local(...)`` runs in-process."""

    def __init__(self, fn: Callable, priority: str | int, num_cpus: float, num_gpus: float, max_retries: int):
        functools.update_wrapper(self, fn)
        self.fn, self.priority = fn, _priority_value(priority)
        self.num_cpus, self.num_gpus, self.max_retries = num_cpus, num_gpus, max_retries
        self._task = None

    def _ray_task(self):
        if self._task is None:
            import ray

            from opentinker.infra.ray_runtime import ensure_ray

            ensure_ray()
            ship_by_value(self.fn.__module__, ray.cloudpickle)
            self._task = ray.remote(self.fn).options(
                num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_retries=self.max_retries
            )
        return self._task

    def remote_call(self, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        return _DISPATCHER.submit(self._ray_task(), args, kwargs, self.priority)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.remote_call(*args, **kwargs).result()

    async def async_call(self, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.wrap_future(self.remote_call(*args, **kwargs))

    def local(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __get__(self, instance: Any, owner: type | None = None):
        """Decorated methods bind like functions; the instance is pickled into the task with the arguments."""
        if instance is None:
            return self
        return _BoundRemote(self, instance)


class _BoundRemote:
    def __init__(self, function: RemoteFunction, instance: Any):
        self._function, self._instance = function, instance

    def remote_call(self, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        return self._function.remote_call(self._instance, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._function(self._instance, *args, **kwargs)

    async def async_call(self, *args: Any, **kwargs: Any) -> Any:
        return await self._function.async_call(self._instance, *args, **kwargs)

    def local(self, *args: Any, **kwargs: Any) -> Any:
        return self._function.fn(self._instance, *args, **kwargs)


def remote(
    fn: Callable | None = None,
    *,
    priority: str | int = "normal",
    num_cpus: float = 1,
    num_gpus: float = 0,
    max_retries: int = 3,
):
    """Decorator (bare or with options) turning ``fn`` into a ``RemoteFunction``; see the module docstring."""
    if num_cpus < 0 or num_gpus < 0:
        raise ValueError(f"remote num_cpus/num_gpus must be >= 0, got num_cpus={num_cpus}, num_gpus={num_gpus}")
    _priority_value(priority)

    def wrap(f: Callable) -> RemoteFunction:
        return RemoteFunction(f, priority, num_cpus, num_gpus, max_retries)

    return wrap(fn) if fn is not None else wrap
