"""The Tinker engine as a Ray actor: base models, LoRA adapters with their optimiser states, sessions and futures
live in one named, detached actor on a Ray instance that outlives the API process (``remote``). The API only forwards
calls here, so an API killed and started again finds the same actor by name and the same SDK clients go on.

This module runs in a Ray worker; the API imports it for the class only, so nothing heavy (torch, the models) is
imported at module level.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
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

    # -- one method per call of the API (``EngineClient.call(EngineActor.<method>, ...)``) -------------------------
    # Database reads and file work run in a thread (``asyncio.to_thread``) so the actor's loop keeps answering.

    async def capabilities(self) -> Any:
        return self._get().capabilities()

    async def usage(self, tenant: str) -> dict[str, Any]:
        return self._get().usage(tenant)  # on the loop: it counts the live futures

    async def create_session(self, tenant: str, request: Any) -> Any:
        return await self._get().create_session(tenant, request)

    async def heartbeat(self, tenant: str, session_id: str) -> Any:
        return self._get().heartbeat(tenant, session_id)

    async def session_info(self, tenant: str, session_id: str) -> dict[str, Any]:
        return self._get().session_info(tenant, session_id)

    async def session_ids(self, tenant: str, limit: int, offset: int) -> list[str]:
        return await asyncio.to_thread(self._get().session_ids, tenant, limit, offset)

    async def create_model(self, tenant: str, request: Any) -> Any:
        return self._get().training.create_model(tenant, request)

    async def get_info(self, tenant: str, model_id: str) -> Any:
        return self._get().training.get_info(tenant, model_id)

    async def optim_step(self, tenant: str, request: Any) -> Any:
        return self._get().training.optim_step(tenant, request)

    async def save_weights(self, tenant: str, request: Any) -> Any:
        return self._get().training.save_weights(tenant, request)

    async def save_weights_for_sampler(self, tenant: str, request: Any) -> Any:
        return self._get().training.save_weights_for_sampler(tenant, request)

    async def load_weights(self, tenant: str, request: Any) -> Any:
        return self._get().training.load_weights(tenant, request)

    async def create_sampling_session(self, tenant: str, request: Any) -> Any:
        return self._get().sampling.create_sampling_session(tenant, request)

    async def get_sampler(self, tenant: str, sampler_id: str) -> Any:
        return self._get().sampling.get_sampler(tenant, sampler_id)

    async def asample(self, tenant: str, request: Any) -> Any:
        return self._get().sampling.asample(tenant, request)

    async def training_runs(self, tenant: str, model_id: str | None = None) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self._get().training_runs, tenant, model_id)

    async def search_checkpoints(
        self,
        tenant: str,
        user_metadata: dict[str, str],
        checkpoint_type: str | None,
        base_models: list[str] | None,
        limit: int,
        after: int | None,
    ) -> tuple[list[dict[str, Any]], int | None]:
        search = self._get().search_checkpoints
        return await asyncio.to_thread(search, tenant, user_metadata, checkpoint_type, base_models, limit, after)

    async def checkpoint_storage(self, tenant: str) -> tuple[int, int]:
        return await asyncio.to_thread(self._get().checkpoint_storage, tenant)

    async def register_checkpoint(self, tenant: str, uri: str, name: str, alias: str | None) -> dict[str, str]:
        return await self._get().register_checkpoint(tenant, uri, name, alias)

    async def tokenizer_files(self, model_name: str) -> dict[str, Any]:
        return await asyncio.to_thread(self._get().tokenizer_files, model_name)

    async def set_tracking_user(self, tenant: str, user: Any) -> None:
        """The tenant's own MLflow user, handed by the API before a call that writes to the tenant's store."""
        self._get().core.tracking.set_user(tenant, user)

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

    async def delete_checkpoint(self, tenant: str, uri: str) -> None:
        with _checkpoint_errors():
            await asyncio.to_thread(self._get().core.store.delete, tenant, uri)

    async def set_checkpoint_ttl(self, tenant: str, uri: str, ttl_seconds: int | None) -> dict[str, Any]:
        with _checkpoint_errors():
            return await asyncio.to_thread(self._get().core.store.set_ttl, tenant, uri, ttl_seconds)

    async def weights_info(self, tenant: str, uri: str) -> Any:
        with _checkpoint_errors():
            return await asyncio.to_thread(self._get().weights_info, tenant, uri)


@contextlib.contextmanager
def _checkpoint_errors() -> Iterator[None]:
    """An unknown checkpoint is 404, a bad path 400."""
    from .store import CheckpointError, CheckpointNotFound

    try:
        yield
    except CheckpointNotFound as error:
        raise NotFound(str(error)) from None
    except CheckpointError as error:
        raise BadRequest(str(error)) from None
