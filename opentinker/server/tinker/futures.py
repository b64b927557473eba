"""Futures: a Tinker call that does work answers at once with a request id; the client long-polls ``retrieve_future``.

A future belongs to its tenant (another tenant's id is unknown, 404), is resolved from the worker thread with an
``Outcome`` (a result, encoded when the client retrieves it, in the format it asks for, or an error with its
category), and is kept ``keep_s`` after it resolves so a client that lost a response can poll again. Each new
future is also handed to ``on_create`` (the server records it in its database, off the event loop).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Category = Literal["user", "server"]


@dataclass(frozen=True)
class Outcome:
    """A finished request: ``json`` (and ``proto``, for the two types the SDK reads as protobuf) or an error."""

    json: Callable[[], dict[str, Any]] | None = None
    proto: Callable[[], bytes] | None = None
    error: str | None = None
    category: Category = "user"

    @classmethod
    def failed(cls, message: str, category: Category = "user") -> Outcome:
        return cls(error=message, category=category)

    @classmethod
    def of(cls, value: dict[str, Any]) -> Outcome:
        return cls(json=lambda: value)


@dataclass(eq=False)
class Future:
    request_id: str
    tenant: str
    kind: str
    """The SDK's request type (``ForwardBackward``, ``OptimStep``, ``Sample``, ...): logs and metrics."""
    owner: str
    """The model or sampler the request is for."""
    session: str = ""
    """The client (SDK session) that sent it."""
    created: float = field(default_factory=time.monotonic)
    started: float | None = None
    finished: float | None = None
    outcome: Outcome | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)


class FutureStore:
    """The server's futures, on its event loop; ``resolve`` may be called from any thread."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        keep_s: float = 600.0,
        on_create: Callable[[Future], None] | None = None,
    ):
        self.loop, self.keep_s, self.on_create = loop, keep_s, on_create
        self._futures: dict[str, Future] = {}

    def create(self, tenant: str, kind: str, owner: str, session: str) -> Future:
        future = Future(f"req-{uuid.uuid4().hex}", tenant, kind, owner, session)
        self._futures[future.request_id] = future
        if self.on_create is not None:
            self.on_create(future)
        return future

    def get(self, tenant: str, request_id: str) -> Future | None:
        future = self._futures.get(request_id)
        return future if future is not None and future.tenant == tenant else None

    def pending(self, tenant: str) -> int:
        return sum(1 for f in self._futures.values() if f.tenant == tenant and f.outcome is None)

    def mark_started(self, future: Future) -> None:
        future.started = time.monotonic()

    def resolve(self, future: Future, outcome: Outcome) -> None:
        """Thread-safe: the outcome is set on the event loop, which wakes the pollers."""
        self.loop.call_soon_threadsafe(self._resolve, future, outcome)

    def _resolve(self, future: Future, outcome: Outcome) -> None:
        if future.outcome is None:
            future.outcome, future.finished = outcome, time.monotonic()
            future.event.set()

    async def wait(self, future: Future, timeout: float) -> bool:
        """Whether ``future`` resolved within ``timeout`` seconds."""
        try:
            await asyncio.wait_for(future.event.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def fail_owner(self, owner: str, message: str) -> None:
        """Fail every unresolved future of ``owner`` (its model or sampler was closed)."""
        for future in list(self._futures.values()):
            if future.owner == owner and future.outcome is None:
                self._resolve(future, Outcome.failed(message))

    def sweep(self) -> None:
        """Forget futures resolved more than ``keep_s`` ago."""
        horizon = time.monotonic() - self.keep_s
        for request_id, future in list(self._futures.items()):
            if future.finished is not None and future.finished < horizon:
                del self._futures[request_id]
