"""The Tinker service behind the router: its sessions and futures here, training clients in ``training``, sampling
clients in ``sampling``, all on one ``core`` (stores, worker, admission).

Sessions are reaped when their heartbeats stop; back-pressure goes through the SDK's own signals: 429 (the SDK waits)
when a tenant has too many requests in flight or holds its training-client limit, 402 when it is over its checkpoint
storage, and the queue state ``paused_capacity`` while other clients' work is ahead of a request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tinker import types

from opentinker.infra.settings import Settings
from opentinker.server import tenants
from opentinker.server.db import Store

from ..errors import NotFound
from .core import Core
from .futures import Future
from .publish import register_checkpoint
from .sampling import Sampling
from .sessions import Session
from .training import Training

log = logging.getLogger(__name__)
TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
        "chat_template.jinja",
        "chat_template.json",
    }
)
"""A tokenizer folder's files that ``AutoTokenizer.from_pretrained`` reads (``tokenizer_files`` hands them out, with
the model's ``config.json``)."""
SESSIONS_KEPT_S = 3600.0
"""A finished or reaped session is remembered this long (its status answers ``get_session`` and heartbeats 410)."""


class TinkerService:
    """One per engine (``actor.EngineActor``), created on the event loop it serves."""

    def __init__(self, settings: Settings, loop: asyncio.AbstractEventLoop, db: Store):
        self.core = Core(settings, loop, db)
        self.sampling = Sampling(self.core)
        self.training = Training(self.core, self.sampling)
        self._tokenizers: dict[str, dict[str, Any]] = {}

    @property
    def settings(self) -> Settings:
        return self.core.settings

    def capabilities(self) -> types.GetServerCapabilitiesResponse:
        models = [
            types.SupportedModel(model_name=self.core.display(b), trainable=True, sampleable=True)
            for b in self.settings.tinker_base_models
        ]
        return types.GetServerCapabilitiesResponse(supported_models=models)

    # -- sessions --------------------------------------------------------------------------------------------------
    async def create_session(self, tenant: str, request: types.CreateSessionRequest) -> types.CreateSessionResponse:
        session = self.core.registry.new_session(tenant, request.user_metadata, request.display_name)
        await asyncio.to_thread(
            self.core.records.add_session, session.session_id, tenant, request.user_metadata, request.display_name
        )
        return types.CreateSessionResponse(session_id=session.session_id)

    def heartbeat(self, tenant: str, session_id: str) -> types.SessionHeartbeatResponse:
        self.core.registry.session(tenant, session_id)
        return types.SessionHeartbeatResponse()

    def session(self, tenant: str, session_id: str) -> Session:
        """A session this process serves (or served within ``SESSIONS_KEPT_S``)."""
        return self.core.registry.session(tenant, session_id, live=False)

    def session_info(self, tenant: str, session_id: str) -> dict[str, Any]:
        """``get_session``'s answer: from this process's registry, else from the database (a session of another
        process, or of this one before a restart, is reported ``expired`` unless it ended otherwise)."""
        try:
            live = self.session(tenant, session_id)
        except NotFound:
            live = None
        if live is not None:
            runs, samplers = list(live.models), list(live.samplers)
            metadata, name, status = live.user_metadata, live.display_name, live.status
        else:
            record = self.core.records.session(tenant, session_id)
            if record is None:
                raise NotFound(f"session {session_id!r} not found")
            runs, samplers = self.core.records.run_ids(session_id), []
            metadata, name = record.user_metadata, record.display_name
            status = "expired" if record.status == "active" else record.status
        body = types.GetSessionResponse(
            training_run_ids=runs, sampler_ids=samplers, user_metadata=metadata, display_name=name
        )
        return {**body.model_dump(mode="json"), "status": status}

    def session_ids(self, tenant: str, limit: int, offset: int) -> list[str]:
        return self.core.records.session_ids(tenant, limit, offset)

    async def close_session(self, session: Session, status: str) -> None:
        """Mark it ``status``, fail what it still has queued and free its adapters and optimiser state. The freeing
        is queued on the worker, not awaited: a busy worker must not hold the client's ``close`` (the SDK re-sends
        a call after 60 s)."""
        core = self.core
        session.status = status
        session.stability.clear()
        models, samplers = core.registry.forget(session)
        for owner in [m.model_id for m in models] + [s.sampler_id for s in samplers]:
            core.futures.fail_owner(owner, f"session {session.session_id} is {status}")

        def free() -> None:
            for model in models:
                if model.trainer is not None:
                    model.trainer.close()
                if model.run is not None:  # after the model's last operation, which may still log to it
                    model.run.end("FINISHED" if status == "finished" else "KILLED")
            for sampler in samplers:
                self.sampling.adapters.release(sampler)

        core.engine.call(free).add_done_callback(_log_free_failure)
        await asyncio.to_thread(core.records.end_session, session.session_id, status)

    async def maintain(self, period: float = 1.0) -> None:
        """Reap sessions whose heartbeats stopped, skip sequence gaps, forget old futures, drop expired checkpoints."""
        core, sweeps = self.core, 0
        try:
            adopted = await asyncio.to_thread(core.store.adopt, self.settings.resolved_data_dir / "tenants")
            if adopted:
                log.info("recorded %d checkpoints of an earlier server in the database", adopted)
        except Exception:
            log.exception("adopting earlier checkpoints failed")
        while True:
            await asyncio.sleep(period)
            try:
                for session in core.registry.lapsed(self.settings.tinker_session_timeout_s):
                    await self.close_session(session, "expired")
                now = time.monotonic()
                for model in list(core.registry.models.values()):
                    model.sequencer.release_stalled(now)
                for session in list(core.registry.sessions.values()):
                    session.stability.expire()
                core.futures.sweep()
                core.registry.prune(keep_s=SESSIONS_KEPT_S)
                sweeps += 1
                if sweeps % 60 == 0:
                    await asyncio.to_thread(core.store.sweep)
                    await asyncio.to_thread(core.records.prune, SESSIONS_KEPT_S)
            except Exception:  # the reaper must outlive one bad round
                log.exception("tinker maintenance round failed")

    def checkpoint_json(self, meta: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint as Tinker's ``Checkpoint``, with SDK 0.39's ``base_model`` (older SDKs ignore it)."""
        return {**types.Checkpoint.model_validate(meta).model_dump(mode="json"), "base_model": self._base(meta)}

    def _base(self, meta: dict[str, Any]) -> str:
        return self.core.display(meta["base_model"])

    def training_runs(self, tenant: str, model_id: str | None = None) -> list[dict[str, Any]]:
        """The tenant's training runs (Tinker's ``TrainingRun`` as JSON), oldest first, with their latest
        checkpoints: those of live training clients, and those of ended ones (a finished session, an earlier server)
        while they have a checkpoint that has not expired. Blocking (database reads)."""
        core = self.core
        live = {
            m.model_id: m
            for m in list(core.registry.models.values())
            if m.tenant == tenant and not m.closed and m.trainer is not None
        }
        rows = core.records.readable_runs(tenant, set(live), model_id)
        latest: dict[tuple[str, str], dict[str, Any]] = {}
        for meta in core.store.list(tenant, model_id):  # oldest first: the last one of each kind wins
            latest[meta["training_run_id"], meta["checkpoint_type"]] = meta
        runs = []
        for row in rows:
            model = live.get(row.model_id)
            session = core.registry.sessions.get(model.session_id) if model is not None else None
            if session is not None:
                last_request = time.time() - (time.monotonic() - session.last_seen)
            else:
                last_request = row.ended_at or row.last_request_at
            run = types.TrainingRun(
                training_run_id=row.model_id,
                base_model=core.display(row.base_model),
                model_owner=tenant,
                is_lora=True,
                lora_rank=row.lora_rank,
                last_request_time=datetime.fromtimestamp(last_request, UTC),
                user_metadata={k: str(v) for k, v in (row.user_metadata or {}).items()} or None,
            ).model_dump(mode="json")
            for field, kind in (("last_checkpoint", "training"), ("last_sampler_checkpoint", "sampler")):
                meta = latest.get((row.model_id, kind))
                run[field] = self.checkpoint_json(meta) if meta is not None else None
            runs.append(run)
        return runs

    def search_checkpoints(
        self,
        tenant: str,
        user_metadata: dict[str, str],
        checkpoint_type: str | None,
        base_models: list[str] | None,
        limit: int,
        after: int | None,
    ) -> tuple[list[dict[str, Any]], int | None]:
        """SDK 0.39's ``search_checkpoints`` over the tenant's live checkpoints (``base_models`` by the names
        clients use; a name this server does not serve matches nothing): (a page as ``checkpoint_json``, the id after
        which the next starts). Blocking (database reads)."""
        bases = None if base_models is None else [self.core.bases[b] for b in base_models if b in self.core.bases]
        metas, last = self.core.store.search(tenant, user_metadata, checkpoint_type, bases, limit, after)
        return [self.checkpoint_json(meta) for meta in metas], last

    def weights_info(self, tenant: str, uri: str) -> types.WeightsInfoResponse:
        """What a checkpoint is of (``get_weights_info_by_tinker_path``): its base model and adapter shape."""
        path, _, meta = self.core.store.open(tenant, uri)
        run = self.core.records.readable_runs(tenant, set(), path.model_id)
        shape = run[0].shape if run else {}
        return types.WeightsInfoResponse(
            base_model=self._base(meta),
            is_lora=True,
            lora_rank=shape.get("rank"),
            train_unembed=shape.get("train_unembed"),
            train_mlp=shape.get("train_mlp"),
            train_attn=shape.get("train_attn"),
        )

    def checkpoint_storage(self, tenant: str) -> tuple[int, int]:
        """(count, bytes) of the tenant's live checkpoints. Blocking (database reads)."""
        return len(self.core.store.list(tenant)), self.core.store.usage_bytes(tenant)

    def usage(self, tenant: str) -> dict[str, Any]:
        core = self.core
        sessions = [s for s in core.registry.sessions.values() if s.tenant == tenant and s.status == "active"]
        return {
            "sessions": len(sessions),
            "training_clients": core.registry.live_models(tenant),
            "samplers": sum(len(s.samplers) for s in sessions),
            "pending_requests": core.futures.pending(tenant),
            "checkpoint_bytes": core.store.usage_bytes(tenant),
            "queue_depth": core.engine.depth(),
            "forward_backward_batching": {"passes": core.engine.train_passes, "requests": core.engine.train_requests},
            "interleaved_requests": core.engine.interleaved,
        }

    # -- futures and the registry ----------------------------------------------------------------------------------
    async def retrieve(self, tenant: str, request_id: str, timeout: float) -> tuple[Future, bool]:
        """(the future, whether it resolved within ``timeout`` seconds); unknown: 404. A client polling its
        results is alive: its session's reaping clock restarts."""
        future = self.core.futures.get(tenant, request_id)
        if future is None:  # held by an engine that stopped (failed, naming what to do), else 404
            outcome = await asyncio.to_thread(self.core.lost_request, tenant, request_id)
            future = Future(request_id, tenant, "lost", "", outcome=outcome)
            future.finished = future.created
            return future, True
        self.core.registry.touch(future.owner)
        return future, await self.core.futures.wait(future, timeout)

    def queue_state(self, future: Future) -> tuple[str, str | None]:
        return self.core.engine.queue_state(future)

    async def register_checkpoint(self, tenant: str, uri: str, name: str, alias: str | None) -> dict[str, str]:
        return await asyncio.to_thread(register_checkpoint, self.core, tenant, uri, name, alias)

    def tokenizer_files(self, name: str) -> dict[str, Any]:
        """The tokenizer of a served base model as files (``opentinker tinker pull-tokenizer``): its name as the API
        says it, a revision (the SHA-1 of the files: a changed tokenizer is a new revision) and each file's bytes.
        Blocking (the first call may convert the bundled model). A model not served: 404."""
        try:
            base = self.core.base_of(name)
        except ValueError as error:
            raise NotFound(str(error)) from None
        if base not in self._tokenizers:
            from opentinker.agents.lm_policy import base_config, load_tokenizer

            cache = tenants.base_model_cache(self.settings)
            tokenizer = load_tokenizer(cache)
            folder = Path(tokenizer.name_or_path)
            files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name in TOKENIZER_FILES}
            # The model's config too: AutoTokenizer reads its model_type to pick the tokenizer class.
            files["config.json"] = base_config(base, tokenizer, cache).to_json_string().encode()
            digest = hashlib.sha1()
            for file_name, data in files.items():
                digest.update(file_name.encode() + b"\0" + data)
            self._tokenizers[base] = {
                "model_name": self.core.display(base),
                "revision": digest.hexdigest(),
                "files": files,
            }
        return self._tokenizers[base]

    def close(self) -> None:
        self.core.engine.close()
        self.core.tracking.close()


def _log_free_failure(done: concurrent.futures.Future) -> None:
    if done.exception() is not None:
        log.error("freeing a closed session's adapters failed: %s", done.exception())
