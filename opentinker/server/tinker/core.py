"""What every Tinker operation shares: the stores, the worker, admission (the SDK's 429 and 402) and queueing.

Calls that do work answer with a future at once and queue an operation; a training model's operations run in its
sequence order (``sessions.Sequencer``); an operation's error caused by the request fails its future with the
category ``user`` (the SDK raises ``RequestFailedError``), any other with ``server``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Callable
from typing import Any

import torch
from tinker import types

from opentinker.agents.lm_sampler import SamplingError
from opentinker.agents.multi_lora import MultiLoraModel
from opentinker.agents.token_losses import LossInputError
from opentinker.infra.settings import Settings
from opentinker.server import tenants
from opentinker.server.db import Store

from ..errors import NotFound, OverQuota, RateLimited
from . import wire
from .engine import TinkerEngine, TrainPart, Work
from .futures import Future, FutureStore, Outcome
from .records import Records
from .sessions import Registry, TrainingModel
from .store import CheckpointError, CheckpointStore
from .tracking import TrackingWriter

DISPLAY_NAMES = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "tiny": "opentinker/tiny-llama"}
"""How the API names the built-in base models (clients may also use the short names)."""
STATE_FILE = "state.pt"
"""A training checkpoint's file: ``AdapterTrainer.state_dict()``."""
log = logging.getLogger(__name__)
USER_ERRORS = (LossInputError, SamplingError, CheckpointError, wire.WireError, ValueError, KeyError)
"""Raised by an operation because of what the request asked: its future fails with category ``user``."""


class Core:
    """One per server process, created on the event loop it serves."""

    def __init__(self, settings: Settings, loop: asyncio.AbstractEventLoop, db: Store):
        """``db``: the server's database (sessions, training runs and checkpoints are recorded there)."""
        self.settings = settings
        self.engine_id = uuid.uuid4().hex
        """This engine's identity in the database's request rows: another's rows are requests an engine took along."""
        self.futures = FutureStore(loop, on_create=self._record)
        self.registry = Registry()
        self.records = Records(db)
        self.store = CheckpointStore(lambda tenant: tenants.data_dir(tenant, settings), db)
        self.tracking = TrackingWriter(settings)
        self.engine = TinkerEngine(
            self.futures, self.load_base, max_rows=settings.tinker_sample_batch_rows, fail=self.failure
        )
        self.bases = {DISPLAY_NAMES.get(b, b): b for b in settings.tinker_base_models}
        self.bases.update({b: b for b in settings.tinker_base_models})
        self.tokenizers: dict[str, str] = {}
        self._names = itertools.count()

    # -- served models ---------------------------------------------------------------------------------------------
    @staticmethod
    def display(base: str) -> str:
        return DISPLAY_NAMES.get(base, base)

    def base_of(self, name: str) -> str:
        """The base model (``agents.lm_policy``'s name) a client's ``base_model`` means; not served: ValueError."""
        if name not in self.bases:
            served = ", ".join(self.display(b) for b in self.settings.tinker_base_models)
            raise ValueError(f"base_model: {name!r} is not served here; this server trains and samples: {served}")
        return self.bases[name]

    def load_base(self, base: str) -> MultiLoraModel:
        """The worker's loader: the base model on this server's device, its tokenizer's id remembered."""
        device = self.settings.tinker_device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.settings.tinker_threads:
            torch.set_num_threads(self.settings.tinker_threads)
        model = MultiLoraModel(base, str(tenants.base_model_cache(self.settings)), device)
        self.tokenizers[base] = self.settings.tinker_tokenizer_id or str(model.tokenizer.name_or_path)
        return model

    def adapter_name(self, prefix: str) -> str:
        """A fresh name for an adapter on a shared base model."""
        return f"{prefix}{next(self._names)}"

    def model(self, tenant: str, model_id: str) -> TrainingModel:
        """A training model this engine serves. One the database knows but the engine does not (its session ended, or
        the engine stopped and took it along) is 404 naming what to do: resume from its last checkpoint."""
        try:
            return self.registry.model(tenant, model_id)
        except NotFound:
            if self.records.run(tenant, model_id) is None:
                raise
        raise NotFound(
            f"model {model_id!r} is no longer served (its session ended, or the Tinker engine stopped and lost its "
            f"steps since its last checkpoint): {self._resume_hint(tenant, model_id)}"
        )

    def _resume_hint(self, tenant: str, model_id: str) -> str:
        saved = [m["tinker_path"] for m in self.store.list(tenant, model_id) if m["checkpoint_type"] == "training"]
        if saved:
            return f"resume from its last checkpoint {saved[-1]} (create_training_client_from_state_with_optimizer)"
        return "it saved no checkpoint (save_state): start a new training client"

    # -- requests --------------------------------------------------------------------------------------------------
    def _record(self, future: Future) -> None:
        """The request's row, written off the event loop (a request whose engine died within that write is then
        unknown: 404)."""
        args = (future.request_id, future.tenant, future.kind, future.owner, self.engine_id)
        done = self.futures.loop.run_in_executor(None, self.records.add_request, *args)
        done.add_done_callback(_log_failure)

    def lost_request(self, tenant: str, request_id: str) -> Outcome:
        """A request this engine does not hold: if another engine held it (that engine stopped, taking its models,
        samplers and results along), its failure naming what to do; else 404."""
        row = self.records.request(tenant, request_id)
        if row is None or row.engine == self.engine_id:
            raise NotFound(f"request {request_id!r} not found")
        if self.records.run(tenant, row.owner) is not None:
            then = self._resume_hint(tenant, row.owner)
        else:
            then = "create the sampling client again (from its checkpoint path or base model) and sample again"
        return Outcome.failed(
            f"{row.kind} request {request_id!r} for {row.owner!r} was lost: the Tinker engine holding it stopped "
            f"before its result was read: {then}",
            "server",
        )

    # -- admission -------------------------------------------------------------------------------------------------
    def admit(self, tenant: str) -> None:
        limit = self.settings.tinker_max_pending_per_tenant
        if self.futures.pending(tenant) >= limit:
            raise RateLimited(
                f"tenant {tenant!r} has {limit} Tinker requests in flight (tinker_max_pending_per_tenant); retry later",
                retry_after=1.0,
            )

    def admit_model(self, tenant: str) -> None:
        self.admit(tenant)
        limit = self.settings.tinker_max_models_per_tenant
        if self.registry.live_models(tenant) >= limit:
            raise RateLimited(  # a slot frees when a session ends or is reaped: the SDK waits for it
                f"tenant {tenant!r} holds {limit} training clients, its limit (tinker_max_models_per_tenant): "
                "finish a session or wait for one to end",
                retry_after=max(1.0, self.settings.tinker_session_timeout_s / 4),
            )

    def admit_checkpoint(self, tenant: str) -> None:
        limit_mb = self.settings.tinker_max_checkpoint_mb_per_tenant
        if self.store.usage_bytes(tenant) >= limit_mb * 2**20:
            raise OverQuota(
                f"tenant {tenant!r} stores {limit_mb:g} MB of Tinker checkpoints, its limit "
                "(tinker_max_checkpoint_mb_per_tenant): delete checkpoints or let their TTL expire"
            )

    # -- queueing --------------------------------------------------------------------------------------------------
    @staticmethod
    def failure(error: Exception) -> Outcome:
        """An operation's exception as its outcome: caused by the request (``USER_ERRORS``) or not (``server``)."""
        if isinstance(error, USER_ERRORS):
            return Outcome.failed(str(error).strip("'\""))
        return Outcome.failed(f"internal error: {type(error).__name__}: {error}", "server")

    def work(self, future: Future, op: Callable[[], Outcome]) -> Work:
        """``op`` for the worker, a request-caused error turned into the future's ``user`` failure."""

        def run() -> Outcome:
            try:
                return op()
            except USER_ERRORS as error:
                return Outcome.failed(str(error).strip("'\""))

        return Work(future, run=run)

    @staticmethod
    def ready(model: TrainingModel) -> None:
        """On the worker, before a model's operation: it still exists and started."""
        if model.closed:
            raise ValueError(f"model {model.model_id} was closed")
        if model.trainer is None:
            raise ValueError(f"model {model.model_id} failed to start")

    def sequenced(
        self,
        model: TrainingModel,
        seq_id: int | None,
        kind: str,
        op: Callable[[], Outcome] | TrainPart,
        admit: Callable[[], None] | None = None,
    ) -> Any:
        """Queue ``op`` in ``model``'s sequence order; a re-sent ``seq_id`` gets the future of its first sending
        (before any check: the first sending passed them, and its effect may be what a check would now refuse).
        ``admit``: a further check a new request must pass (a quota). A ``TrainPart`` may share its pass with other
        clients' (``engine``)."""
        seq_id = seq_id or 0
        future = model.sequencer.duplicate(seq_id) if seq_id else None
        if future is None:
            self.admit(model.tenant)
            if admit is not None:
                admit()
            future = self.futures.create(model.tenant, kind, model.model_id, model.session_id)

            if isinstance(op, TrainPart):
                work = Work(future, train=op, base=model.base)
            else:

                def checked(op: Callable[[], Outcome] = op) -> Outcome:
                    self.ready(model)
                    return op()

                work = self.work(future, checked)
            model.sequencer.offer(seq_id, future, lambda: self.engine.submit(work))
        return types.UntypedAPIFuture(request_id=future.request_id, model_id=model.model_id)


def _log_failure(done: asyncio.Future) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.warning("could not record a Tinker request: %s", done.exception())
