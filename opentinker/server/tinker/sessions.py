"""Sessions, the training models and samplers they own, and the order a model's requests run in.

A session is one SDK ``ServiceClient``: it heartbeats every 10 s; one that stops (a crashed or killed client) is
reaped after ``timeout`` seconds and its adapters freed. Its training models are ``<session>:train:<n>`` (the id the
SDK itself derives for a model created by ``load_weights``), its samplers ``<session>:sample:<n>``. Everything is
looked up by (tenant, id): another tenant's id is not found.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentinker.agents.multi_lora import AdapterShape

from ..errors import BadRequest, Gone, NotFound
from .futures import Future
from .stability import StabilityLog

SEEN_KEPT = 256
"""Sequence ids remembered per model, so a re-sent request gets its first answer instead of running twice."""


@dataclass(eq=False)
class Sequencer:
    """A training model's requests in sequence order: the SDK numbers them 1, 2, ... and may send one again
    (a retry after a lost response). A request that arrives early waits for the ones before it; a gap that stays
    open ``gap_timeout`` seconds (a request the client never managed to send) is skipped."""

    gap_timeout: float = 30.0
    next: int = 1
    waiting: dict[int, tuple[Future, Callable[[], None]]] = field(default_factory=dict)
    seen: dict[int, Future] = field(default_factory=dict)
    stalled_since: float | None = None

    def duplicate(self, seq_id: int) -> Future | None:
        return self.seen.get(seq_id)

    def offer(self, seq_id: int, future: Future, submit: Callable[[], None]) -> None:
        """Queue ``submit`` to run once every request before ``seq_id`` has (0: the SDK sent none, run next)."""
        seq_id = seq_id or max([self.next, *self.waiting]) + (1 if self.waiting else 0)
        if seq_id < self.next or seq_id in self.waiting:
            raise BadRequest(f"seq_id: {seq_id} was already used by this model (next expected: {self.next})")
        self.seen[seq_id] = future
        while len(self.seen) > SEEN_KEPT:
            del self.seen[min(self.seen)]
        self.waiting[seq_id] = (future, submit)
        self._drain()

    def release_stalled(self, now: float) -> None:
        if self.waiting and self.stalled_since is not None and now - self.stalled_since > self.gap_timeout:
            self.next = min(self.waiting)
            self._drain()

    def _drain(self) -> None:
        while self.next in self.waiting:
            _, submit = self.waiting.pop(self.next)
            submit()
            self.next += 1
        self.stalled_since = time.monotonic() if self.waiting else None


@dataclass(eq=False)
class TrainingModel:
    model_id: str
    tenant: str
    session_id: str
    base: str
    """The base model's name in ``agents.lm_policy`` terms (``smollm2``, ``tiny`` or a folder)."""
    shape: AdapterShape
    adapter: str
    """Its adapter's name on the shared base model."""
    sequencer: Sequencer
    trainer: Any = None
    """The ``AdapterTrainer``, once created on the worker."""
    run: Any = None
    """Its tracking run (``tracking.ClientRun``)."""
    user_metadata: dict[str, Any] | None = None
    closed: bool = False
    creation: Future | None = None
    """The request that created it (a re-sent ``create_model`` gets it back)."""
    snapshots: list[SamplingSession] = field(default_factory=list)
    """Its ``save_weights_and_get_sampling_client`` samplers, oldest first (the service keeps the last few)."""


@dataclass(eq=False)
class SamplingSession:
    """What ``create_sampling_session`` made: one SDK ``SamplingClient``'s base model and adapter (the generation
    itself is ``agents.lm_sampler.Sampler``'s, on the engine's worker)."""

    sampler_id: str
    tenant: str
    session_id: str
    base: str
    adapter: str | None
    """Its adapter on the base model (shared by samplers of the same checkpoint); None: the base model."""
    model_path: str | None = None
    source: TrainingModel | None = None
    """The training model it was snapshotted from or saved by (sampling metrics go to its run)."""
    origin: tuple[str | None, str | None] | None = None
    """The ``(model_path, base_model)`` of the ``create_sampling_session`` that made it: a re-send is the same call."""
    loaded: asyncio.Future | None = None
    """Its checkpoint's adapter loading on the worker; its sampling requests wait for it. None: nothing to load."""
    sent: dict[int, Any] = field(default_factory=dict)
    """Its ``asample`` answers by the SDK's ``seq_id``, so a re-sent request gets its first answer (the last
    ``SEEN_KEPT``)."""


@dataclass(eq=False)
class Session:
    session_id: str
    tenant: str
    user_metadata: dict[str, Any] | None = None
    display_name: str | None = None
    last_seen: float = field(default_factory=time.monotonic)
    status: str = "active"
    """``active``, ``finished`` (the client closed it) or ``expired`` (its heartbeats stopped)."""
    models: dict[str, TrainingModel] = field(default_factory=dict)
    samplers: dict[str, SamplingSession] = field(default_factory=dict)
    stability: StabilityLog = field(default_factory=StabilityLog)
    """Its sequences sampled with ``record_stability_info`` (``stable_reinforce``)."""


class Registry:
    """Every session, model and sampler of every tenant (the event loop's; not shared with the worker)."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, SamplingSession] = {}

    def new_session(self, tenant: str, user_metadata: dict | None, display_name: str | None) -> Session:
        session = Session(uuid.uuid4().hex, tenant, user_metadata, display_name)
        self.sessions[session.session_id] = session
        return session

    def session(self, tenant: str, session_id: str, live: bool = True) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.tenant != tenant:
            raise NotFound(f"session {session_id!r} not found")
        if live and session.status != "active":
            raise Gone(f"session {session_id!r} is {session.status}")
        session.last_seen = time.monotonic()
        return session

    def model(self, tenant: str, model_id: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None or model.tenant != tenant or model.closed:
            raise NotFound(f"model {model_id!r} not found")
        self.sessions[model.session_id].last_seen = time.monotonic()
        return model

    def sampler(self, tenant: str, sampler_id: str) -> SamplingSession:
        sampler = self.samplers.get(sampler_id)
        if sampler is None or sampler.tenant != tenant:
            raise NotFound(f"sampler {sampler_id!r} not found")
        self.sessions[sampler.session_id].last_seen = time.monotonic()
        return sampler

    def touch(self, owner: str) -> None:
        """A client polling a result of its model or sampler is alive: its session's reaping clock restarts."""
        record = self.models.get(owner) or self.samplers.get(owner)
        session = self.sessions.get(record.session_id) if record is not None else None
        if session is not None:
            session.last_seen = time.monotonic()

    def add_model(self, session: Session, model: TrainingModel) -> None:
        if model.model_id in self.models:
            raise BadRequest(f"model_seq_id: model {model.model_id!r} already exists in this session")
        session.models[model.model_id] = model
        self.models[model.model_id] = model

    def add_sampler(self, session: Session, sampler: SamplingSession) -> None:
        if sampler.sampler_id in self.samplers:
            raise BadRequest(f"sampling_session_seq_id: sampler {sampler.sampler_id!r} already exists in this session")
        session.samplers[sampler.sampler_id] = sampler
        self.samplers[sampler.sampler_id] = sampler

    def drop_sampler(self, sampler: SamplingSession) -> None:
        self.samplers.pop(sampler.sampler_id, None)
        session = self.sessions.get(sampler.session_id)
        if session is not None:
            session.samplers.pop(sampler.sampler_id, None)

    def live_models(self, tenant: str) -> int:
        return sum(1 for m in self.models.values() if m.tenant == tenant and not m.closed)

    def forget(self, session: Session) -> tuple[list[TrainingModel], list[SamplingSession]]:
        """Remove the session's models and samplers from the lookups; the caller frees their memory."""
        models = [self.models.pop(m) for m in list(session.models) if m in self.models]
        samplers = [self.samplers.pop(s) for s in list(session.samplers) if s in self.samplers]
        for model in models:
            model.closed = True
        return models, samplers

    def prune(self, keep_s: float) -> None:
        """Forget sessions that ended more than ``keep_s`` seconds ago."""
        horizon = time.monotonic() - keep_s
        for session_id, session in list(self.sessions.items()):
            if session.status != "active" and session.last_seen < horizon:
                del self.sessions[session_id]

    def lapsed(self, timeout: float) -> list[Session]:
        horizon = time.monotonic() - timeout
        return [s for s in self.sessions.values() if s.status == "active" and s.last_seen < horizon]
