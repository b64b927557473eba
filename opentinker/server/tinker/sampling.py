"""Sampling clients: ``create_sampling_session``, ``asample``, and the adapters they read.

A sampler reads the base model, an adapter loaded from a checkpoint (one per checkpoint, shared by all its samplers,
freed with the last), or a private copy of a training adapter (``save_weights_and_get_sampling_client``; the last
``SNAPSHOTS_KEPT`` per training client are kept). ``asample`` queues the request; the worker batches it with the
other queued ones (``engine``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tinker import types

from opentinker.agents.multi_lora import AdapterShape

from ..errors import BadRequest, NotFound
from . import wire
from .core import STATE_FILE, Core
from .engine import TinkerEngine, Work
from .futures import Future, Outcome
from .sessions import SEEN_KEPT, SamplingSession, TrainingModel
from .store import CheckpointError

log = logging.getLogger(__name__)
SNAPSHOTS_KEPT = 4
"""``save_weights_and_get_sampling_client`` samplers kept per training client: an RL loop makes one a step and
drops the last; an older one answers 404 once evicted (its adapter's memory is freed)."""


class SamplerAdapters:
    """The samplers' adapters on the shared base models; every method runs on the worker thread."""

    def __init__(self, engine: TinkerEngine):
        self.engine = engine
        self._loaded: dict[tuple[str, str], list] = {}
        """(base, checkpoint folder or snapshot name) -> [adapter name, samplers using it]."""

    def load(self, sampler: SamplingSession, folder: Path, name: str) -> None:
        key = (sampler.base, str(folder))
        if key not in self._loaded:
            model = self.engine.model(sampler.base)
            if (folder / STATE_FILE).is_file():
                state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
                model.add(name, AdapterShape(**state["shape"]), seed=0)
                model.load_state(name, state["adapter"])
            else:
                model.load(name, folder)
            self._loaded[key] = [name, 0]
        self._loaded[key][1] += 1
        sampler.adapter = self._loaded[key][0]

    def snapshot(self, sampler: SamplingSession, source: TrainingModel) -> None:
        self.engine.model(source.base).copy(source.adapter, sampler.adapter)
        self._loaded[(sampler.base, sampler.adapter)] = [sampler.adapter, 1]

    def release(self, sampler: SamplingSession) -> None:
        for key, entry in list(self._loaded.items()):
            if key[0] == sampler.base and entry[0] == sampler.adapter:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._loaded[key]
                    self.engine.model(sampler.base).remove(sampler.adapter)
                return


class Sampling:
    def __init__(self, core: Core):
        self.core = core
        self.adapters = SamplerAdapters(core.engine)

    def create_sampling_session(
        self, tenant: str, request: types.CreateSamplingSessionRequest
    ) -> types.CreateSamplingSessionResponse:
        """Answered at once: the SDK waits for this answer itself (no future) and re-sends the same request after
        60 s, so a checkpoint's adapter loads on the worker after the answer and the sampler's first requests wait
        for it (``asample``). A re-send (same session and ``sampling_session_seq_id``) gets the same answer."""
        core = self.core
        session = core.registry.session(tenant, request.session_id)
        sampler_id = f"{session.session_id}:sample:{request.sampling_session_seq_id}"
        origin = (request.model_path, request.base_model)
        earlier = session.samplers.get(sampler_id)
        if earlier is not None and earlier.origin == origin:
            return types.CreateSamplingSessionResponse(sampling_session_id=sampler_id)
        if request.model_path is None:
            if request.base_model is None:
                raise BadRequest("create_sampling_session: give model_path or base_model")
            try:
                base = core.base_of(request.base_model)
            except ValueError as error:
                raise BadRequest(str(error)) from error
            sampler = SamplingSession(sampler_id, tenant, session.session_id, base, None, origin=origin)
            core.registry.add_sampler(session, sampler)
            return types.CreateSamplingSessionResponse(sampling_session_id=sampler_id)
        try:
            _, folder, meta = core.store.open(tenant, request.model_path)
        except CheckpointError as error:
            raise NotFound(str(error)) from None
        base = meta["base_model"]
        if base not in core.settings.tinker_base_models:
            raise BadRequest(f"model_path: {request.model_path} is of {core.display(base)!r}, not served here")
        if request.base_model and core.bases.get(request.base_model) != base:
            raise BadRequest(f"base_model: {request.model_path} is of {core.display(base)!r}")
        sampler = SamplingSession(sampler_id, tenant, session.session_id, base, None, request.model_path, origin=origin)
        core.registry.add_sampler(session, sampler)
        name = core.adapter_name("c")
        load = core.engine.call(lambda: self.adapters.load(sampler, folder, name), interleave=True)
        sampler.loaded = asyncio.wrap_future(load)
        sampler.loaded.add_done_callback(lambda done: _log_load_failure(sampler, done))
        return types.CreateSamplingSessionResponse(sampling_session_id=sampler_id)

    def snapshot(self, model: TrainingModel, request: types.SaveWeightsForSamplerRequest) -> Any:
        """``save_weights_and_get_sampling_client``: a sampler on a copy of the adapter as it is at this point of
        the model's sequence."""
        core = self.core
        earlier = model.sequencer.duplicate(request.seq_id) if request.seq_id else None
        if earlier is not None:  # the SDK sent it again: the first sending's future
            return types.UntypedAPIFuture(request_id=earlier.request_id, model_id=model.model_id)
        core.admit(model.tenant)
        session = core.registry.session(model.tenant, model.session_id)
        sampler = SamplingSession(
            f"{session.session_id}:sample:{request.sampling_session_seq_id}",
            model.tenant,
            session.session_id,
            model.base,
            adapter=core.adapter_name("s"),
            source=model,
        )
        core.registry.add_sampler(session, sampler)
        model.snapshots.append(sampler)
        while len(model.snapshots) > SNAPSHOTS_KEPT:
            old = model.snapshots.pop(0)
            core.registry.drop_sampler(old)
            core.engine.call(lambda old=old: self.adapters.release(old))

        def op() -> Outcome:
            self.adapters.snapshot(sampler, model)
            body = types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sampler.sampler_id)
            return Outcome.of(body.model_dump(mode="json"))

        return core.sequenced(model, request.seq_id, "SaveWeightsForSampler", op)

    def get_sampler(self, tenant: str, sampler_id: str) -> types.GetSamplerResponse:
        sampler = self.core.registry.sampler(tenant, sampler_id)
        base = self.core.display(sampler.base)
        return types.GetSamplerResponse(sampler_id=sampler_id, base_model=base, model_path=sampler.model_path)

    def asample(self, tenant: str, request: types.SampleRequest) -> types.UntypedAPIFuture:
        """A future at once; the work is queued once the sampler's adapter is loaded. A re-send (same sampler and
        ``seq_id``) gets the first sending's future."""
        core = self.core
        if not request.sampling_session_id:
            raise BadRequest("sampling_session_id: required (create a sampling client first)")
        sampler = core.registry.sampler(tenant, request.sampling_session_id)
        if request.seq_id is not None and request.seq_id in sampler.sent:
            return sampler.sent[request.seq_id]
        core.admit(tenant)
        future = core.futures.create(tenant, "Sample", sampler.sampler_id, sampler.session_id)
        ids = [f"{future.request_id}:{i}" for i in range(request.num_samples)]
        answer = types.UntypedAPIFuture(request_id=future.request_id, sample_sequence_ids=ids)
        if request.seq_id is not None:
            sampler.sent[request.seq_id] = answer
            while len(sampler.sent) > SEEN_KEPT:
                del sampler.sent[min(sampler.sent)]
        try:
            job = wire.sample_job(request, None)
        except wire.WireError as error:
            core.futures.resolve(future, Outcome.failed(str(error)))
            return answer

        session = core.registry.sessions[sampler.session_id]
        record = bool(request.record_stability_info)

        def encode(result: Any) -> Outcome:
            if record:  # stable_reinforce's training requests read them (stability.resolve)
                session.stability.record(ids, job.prompt, result.completions)
            return Outcome(json=lambda: wire.sample_json(result), proto=lambda: wire.sample_proto(result))

        def submit(_: Any = None) -> None:
            if sampler.loaded is not None and sampler.loaded.exception() is not None:
                error = sampler.loaded.exception()
                core.futures.resolve(future, core.failure(error))
                return
            ready = dataclasses.replace(job, adapter=sampler.adapter)
            work = Work(future, job=ready, base=sampler.base, encode=encode, after=self._tracker(sampler, future))
            core.engine.submit(work)

        if sampler.loaded is None or sampler.loaded.done():
            submit()
        else:
            sampler.loaded.add_done_callback(submit)
        return answer

    @staticmethod
    def _tracker(sampler: SamplingSession, future: Future) -> Callable[[Any, float], None] | None:
        """Latency and tokens/s onto the run of the training client the sampler came from."""
        if sampler.source is None:
            return None

        def track(result: Any, seconds: float) -> None:
            tokens = sum(len(c.tokens) for c in result.completions)
            if sampler.source.run is not None:
                sampler.source.run.sample(time.monotonic() - future.created, tokens, seconds)

        return track


def _log_load_failure(sampler: SamplingSession, done: asyncio.Future) -> None:
    """A checkpoint that failed to load fails its sampler's requests (``asample``); the log says why once."""
    if not done.cancelled() and done.exception() is not None:
        log.warning("sampler %s: loading %s failed: %s", sampler.sampler_id, sampler.model_path, done.exception())
