"""The Tinker engine as a Ray actor: base models, LoRA adapters with their optimiser states, sessions and futures
live in one named, detached actor on a Ray instance that outlives the API process (``remote``). The API only forwards
calls here, so an API killed and started again finds the same actor by name and the same SDK clients go on.

This module runs in a Ray worker; the API imports it for the class only, so nothing heavy (torch, the models) is
imported at module level.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any

from opentinker.infra.settings import Settings

from ..errors import BadRequest, NotFound

log = logging.getLogger(__name__)


class EngineActor:
    """Ray async actor around ``TinkerService``: its event loop is the service's, its worker thread the engine's."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._service: Any = None
        self._maintenance: asyncio.Task | None = None

    def _get(self) -> Any:
        """The service, made on the actor's event loop by the first call (``__init__`` runs outside it)."""
        if self._service is None:
            from opentinker.server.db import Store

            from .service import TinkerService

            db = Store(self.settings.server_database)
            self._service = TinkerService(self.settings, asyncio.get_running_loop(), db)
            self._maintenance = asyncio.create_task(self._service.maintain())
        return self._service

    async def ready(self) -> bool:
        self._get()
        return True

    async def call(self, method: str, *args: Any, blocking: bool = False) -> Any:
        """``TinkerService``'s ``method`` (dotted: ``training.create_model``); ``blocking`` ones (database reads,
        file conversions) run in a thread so the actor's loop keeps answering."""
        target = self._get()
        for part in method.split("."):
            target = getattr(target, part)
        if blocking:
            return await asyncio.to_thread(target, *args)
        result = target(*args)
        return await result if inspect.isawaitable(result) else result

    async def forward_backward(self, tenant: str, body: bytes, encoding: str | None) -> Any:
        """A protobuf ``ForwardBackwardRequest`` as the SDK sent it (decoded here: the API holds no wire types)."""
        from . import wire

        try:
            call = wire.decode_forward_backward(body, encoding)
        except wire.WireError as error:
            raise BadRequest(str(error)) from None
        return self._get().training.forward_backward(tenant, call)

    async def finish_session(self, tenant: str, session_id: str) -> None:
        service = self._get()
        session = service.session(tenant, session_id)
        if session.status == "active":
            await service.close_session(session, "finished")

    async def retrieve(self, tenant: str, request_id: str, timeout: float, proto: bool) -> tuple[int, str, Any]:
        """``retrieve_future``'s answer: (status, media type, body): the result (protobuf when ``proto`` and the type
        has a protobuf form), 408 "try again" with the queue state while pending, ``{"error", "category"}``."""
        service = self._get()
        future, done = await service.retrieve(tenant, request_id, timeout)
        if not done:
            state, reason = service.queue_state(future)
            again = {"type": "try_again", "request_id": request_id, "queue_state": state, "queue_state_reason": reason}
            return 408, "application/json", again
        outcome = future.outcome
        if outcome.error is not None:
            return 200, "application/json", {"error": outcome.error, "category": outcome.category}
        if outcome.proto is not None and proto:
            return 200, "application/x-protobuf", outcome.proto()
        return 200, "application/json", outcome.json()

    async def checkpoints(self, tenant: str, model_id: str | None) -> dict[str, Any]:
        """The tenant's live checkpoints (of one training run: a run the tenant has no record of is 404, as
        another tenant's is for every other call)."""
        service = self._get()
        core = service.core
        metas = await asyncio.to_thread(core.store.list, tenant, model_id)
        if model_id is not None and not metas and await asyncio.to_thread(core.records.run, tenant, model_id) is None:
            raise NotFound(f"training run {model_id!r} not found")
        return {"checkpoints": [service.checkpoint_json(meta) for meta in metas], "cursor": None}

    async def checkpoint_op(self, op: str, tenant: str, *args: Any) -> Any:
        """``delete`` or ``set_ttl`` on the checkpoint store, or the service's ``weights_info``: an unknown checkpoint
        is 404, a bad path 400."""
        from .store import CheckpointError, CheckpointNotFound

        service = self._get()
        fn = service.weights_info if op == "weights_info" else getattr(service.core.store, op)
        try:
            return await asyncio.to_thread(fn, tenant, *args)
        except CheckpointNotFound as error:
            raise NotFound(str(error)) from None
        except CheckpointError as error:
            raise BadRequest(str(error)) from None
