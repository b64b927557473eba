"""What each Tinker call does: between the router (HTTP, auth, wire decoding) and the worker (models).

Calls that do work answer with a future at once and queue an operation; training operations of one model run in
the model's sequence order (``sessions.Sequencer``). Every lookup is by the caller's tenant. Back-pressure goes
through the SDK's own signals: 429 when a tenant has too many requests in flight, 402 when it is over its models
or checkpoint-storage quota, and the queue state ``paused_capacity`` while other clients' work is ahead.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from tinker import types

from opentinker.agents.adapter_trainer import AdapterTrainer
from opentinker.agents.lm_sampler import SamplingError
from opentinker.agents.multi_lora import AdapterShape, MultiLoraModel
from opentinker.agents.token_losses import LossInputError
from opentinker.infra.settings import Settings
from opentinker.server import tenants

from . import wire
from .engine import Engine, Work
from .errors import BadRequest, NotFound, OverQuota, RateLimited
from .futures import Future, FutureStore, Outcome
from .sampling import STATE_FILE, SamplerAdapters, sampler_source
from .sessions import Registry, Sampler, Sequencer, Session, TrainingModel
from .store import CheckpointError, CheckpointPath, CheckpointStore
from .tracking import TrackingWriter

DISPLAY_NAMES = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "tiny": "opentinker/tiny-llama"}
"""How the API names the built-in base models (clients may also use the short names)."""
SNAPSHOTS_KEPT = 4
"""``save_weights_and_get_sampling_client`` samplers kept per training client: an RL loop makes one a step and
drops the last; an older one answers 404 once evicted (its adapter's memory is freed)."""
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_REGISTRY_LOCK = threading.Lock()
"""MLflow's model logging is process-wide (its tracking URI): one registration at a time."""
USER_ERRORS = (LossInputError, SamplingError, CheckpointError, wire.WireError, ValueError, KeyError)
"""Raised by an operation because of what the request asked: the future fails with category ``user``."""


class TinkerService:
    """One per server process (``app.state.tinker``), created on the event loop it serves."""

    def __init__(self, settings: Settings, loop: asyncio.AbstractEventLoop):
        self.settings = settings
        self.futures = FutureStore(loop)
        self.registry = Registry()
        self.store = CheckpointStore(lambda tenant: tenants.data_dir(tenant, settings))
        self.tracking = TrackingWriter(settings)
        self.engine = Engine(self.futures, self._load_base, max_rows=settings.tinker_sample_batch_rows)
        self.adapters = SamplerAdapters(self.engine)
        self.bases = {DISPLAY_NAMES.get(b, b): b for b in settings.tinker_base_models}
        self.bases.update({b: b for b in settings.tinker_base_models})
        self.tokenizers: dict[str, str] = {}
        self._names = itertools.count()

    # -- served models ---------------------------------------------------------------------------------------------
    def base_of(self, name: str) -> str:
        if name not in self.bases:
            served = ", ".join(DISPLAY_NAMES.get(b, b) for b in self.settings.tinker_base_models)
            raise ValueError(f"base_model: {name!r} is not served here; this server trains and samples: {served}")
        return self.bases[name]

    def capabilities(self) -> types.GetServerCapabilitiesResponse:
        return types.GetServerCapabilitiesResponse(
            supported_models=[
                types.SupportedModel(model_name=DISPLAY_NAMES.get(b, b), trainable=True, sampleable=True)
                for b in self.settings.tinker_base_models
            ]
        )

    def _load_base(self, base: str) -> MultiLoraModel:
        """The worker's loader: the base model on this server's device, its tokenizer's id remembered."""
        device = self.settings.tinker_device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.settings.tinker_threads:
            torch.set_num_threads(self.settings.tinker_threads)
        cache = self.settings.tinker_cache_dir or str(self.settings.resolved_data_dir / "llm-cache")
        model = MultiLoraModel(base, cache, device)
        self.tokenizers[base] = self.settings.tinker_tokenizer_id or str(model.tokenizer.name_or_path)
        return model

    # -- sessions --------------------------------------------------------------------------------------------------
    def create_session(self, tenant: str, request: types.CreateSessionRequest) -> types.CreateSessionResponse:
        session = self.registry.new_session(tenant, request.user_metadata, request.display_name)
        return types.CreateSessionResponse(session_id=session.session_id)

    def heartbeat(self, tenant: str, session_id: str) -> types.SessionHeartbeatResponse:
        self.registry.session(tenant, session_id)
        return types.SessionHeartbeatResponse()

    async def close_session(self, session: Session, status: str) -> None:
        """Mark it ``status``, fail what it still has queued and free its adapters and optimiser state."""
        session.status = status
        models, samplers = self.registry.forget(session)
        for owner in [m.model_id for m in models] + [s.sampler_id for s in samplers]:
            self.futures.fail_owner(owner, f"session {session.session_id} is {status}")

        def free() -> None:
            for model in models:
                if model.trainer is not None:
                    model.trainer.close()
            for sampler in samplers:
                self.adapters.release(sampler)

        await asyncio.wrap_future(self.engine.call(free))
        for model in models:
            if model.run is not None:
                model.run.end("FINISHED" if status == "finished" else "KILLED")

    async def maintain(self, period: float = 1.0) -> None:
        """Reap sessions whose heartbeats stopped, skip sequence gaps, forget old futures, drop expired checkpoints."""
        sweeps = 0
        while True:
            await asyncio.sleep(period)
            for session in self.registry.lapsed(self.settings.tinker_session_timeout_s):
                await self.close_session(session, "expired")
            now = time.monotonic()
            for model in list(self.registry.models.values()):
                model.sequencer.release_stalled(now)
            self.futures.sweep()
            sweeps += 1
            if sweeps % 60 == 0:
                await asyncio.to_thread(self.store.sweep, self.settings.resolved_data_dir / "tenants")

    def usage(self, tenant: str) -> dict[str, Any]:
        sessions = [s for s in self.registry.sessions.values() if s.tenant == tenant and s.status == "active"]
        return {
            "sessions": len(sessions),
            "training_clients": self.registry.live_models(tenant),
            "samplers": sum(len(s.samplers) for s in sessions),
            "pending_requests": self.futures.pending(tenant),
            "checkpoint_bytes": self.store.usage_bytes(tenant),
            "queue_depth": self.engine.depth(),
        }

    def close(self) -> None:
        self.engine.close()
        self.tracking.close()

    # -- admission -------------------------------------------------------------------------------------------------
    def _admit(self, tenant: str) -> None:
        limit = self.settings.tinker_max_pending_per_tenant
        if self.futures.pending(tenant) >= limit:
            raise RateLimited(
                f"tenant {tenant!r} has {limit} Tinker requests in flight (tinker_max_pending_per_tenant); retry later",
                retry_after=1.0,
            )

    def _admit_model(self, tenant: str) -> None:
        self._admit(tenant)
        limit = self.settings.tinker_max_models_per_tenant
        if self.registry.live_models(tenant) >= limit:
            raise OverQuota(
                f"tenant {tenant!r} holds {limit} training clients, its limit (tinker_max_models_per_tenant): "
                "finish a session or wait for one to end"
            )

    def _admit_checkpoint(self, tenant: str) -> None:
        limit_mb = self.settings.tinker_max_checkpoint_mb_per_tenant
        if self.store.usage_bytes(tenant) >= limit_mb * 2**20:
            raise OverQuota(
                f"tenant {tenant!r} stores {limit_mb:g} MB of Tinker checkpoints, its limit "
                "(tinker_max_checkpoint_mb_per_tenant): delete checkpoints or let their TTL expire"
            )

    def _queue(self, future: Future, op: Callable[[], Outcome]) -> Work:
        def run() -> Outcome:
            try:
                return op()
            except USER_ERRORS as error:
                return Outcome.failed(str(error).strip("'\""))

        return Work(future, run=run)

    def _sequenced(self, model: TrainingModel, seq_id: int | None, kind: str, op: Callable[[], Outcome]) -> Any:
        """Queue ``op`` in ``model``'s sequence order; a re-sent ``seq_id`` gets the future of its first sending."""
        seq_id = seq_id or 0
        future = model.sequencer.duplicate(seq_id) if seq_id else None
        if future is None:
            self._admit(model.tenant)
            future = self.futures.create(model.tenant, kind, model.model_id)

            def checked() -> Outcome:
                if model.closed:
                    return Outcome.failed(f"model {model.model_id} was closed")
                if model.trainer is None:
                    return Outcome.failed(f"model {model.model_id} failed to start")
                return op()

            work = self._queue(future, checked)
            model.sequencer.offer(seq_id, future, lambda: self.engine.submit(work))
        return types.UntypedAPIFuture(request_id=future.request_id, model_id=model.model_id)

    # -- training --------------------------------------------------------------------------------------------------
    def create_model(self, tenant: str, request: types.CreateModelRequest) -> types.UntypedAPIFuture:
        session = self.registry.session(tenant, request.session_id)
        self._admit_model(tenant)
        model = self._new_model(session, request.model_seq_id, request.user_metadata)
        future = self.futures.create(tenant, "CreateModel", model.model_id)

        def op() -> Outcome:
            model.base = self.base_of(request.base_model)
            if request.optimizer_config.type != "adamw":
                raise ValueError(f"optimizer_config: only adamw is supported, got {request.optimizer_config.type!r}")
            lora = request.lora_config or types.LoraConfig(rank=32)
            model.shape = AdapterShape(lora.rank, lora.train_attn, lora.train_mlp, lora.train_unembed)
            self._start(model, seed=lora.seed)
            return Outcome.of(types.CreateModelResponse(model_id=model.model_id).model_dump(mode="json"))

        self.engine.submit(self._queue(future, self._or_forget(model, op)))
        return types.UntypedAPIFuture(request_id=future.request_id, model_id=model.model_id)

    def _new_model(self, session: Session, model_seq_id: int | None, metadata: dict | None) -> TrainingModel:
        if model_seq_id is None:
            raise BadRequest("model_seq_id: required")
        model = TrainingModel(
            model_id=f"{session.session_id}:train:{model_seq_id}",
            tenant=session.tenant,
            session_id=session.session_id,
            base="",
            shape=AdapterShape(),
            adapter=f"m{next(self._names)}",
            sequencer=Sequencer(),
            user_metadata=metadata,
        )
        self.registry.add_model(session, model)
        return model

    def _or_forget(self, model: TrainingModel, op: Callable[[], Outcome]) -> Callable[[], Outcome]:
        """``op``, after which a model that did not start is dropped (its id free again, its quota slot released)."""

        def run() -> Outcome:
            try:
                outcome = op()
            except BaseException:
                outcome = None
                raise
            finally:
                if model.trainer is None or (outcome is not None and outcome.error):
                    model.closed = True
            return outcome

        return run

    def _start(self, model: TrainingModel, seed: int | None) -> AdapterTrainer:
        """On the worker: the model's adapter and optimiser, and its MLflow run."""
        model.trainer = AdapterTrainer(self.engine.model(model.base), model.adapter, model.shape, seed)
        params = {
            "base_model": DISPLAY_NAMES.get(model.base, model.base),
            "lora_rank": model.shape.rank,
            **vars(model.shape),
        }
        tags = {"tinker.model_id": model.model_id, "tinker.session_id": model.session_id}
        model.run = self.tracking.start_run(model.tenant, f"tinker-{model.model_id}", params, tags)
        self.tracking.flush()  # the run exists before the client hears of its model (its store, too, on first use)
        return model.trainer

    def get_info(self, tenant: str, model_id: str) -> types.GetInfoResponse:
        model = self.registry.model(tenant, model_id)
        name = DISPLAY_NAMES.get(model.base, model.base)
        data = types.ModelData(arch="llama", model_name=name, tokenizer_id=self.tokenizers.get(model.base))
        return types.GetInfoResponse(
            model_id=model_id, model_data=data, is_lora=True, lora_rank=model.shape.rank, model_name=name
        )

    def forward_backward(self, tenant: str, call: wire.ForwardBackwardCall) -> types.UntypedAPIFuture:
        model = self.registry.model(tenant, call.model_id)

        def op() -> Outcome:
            started = time.perf_counter()
            result = model.trainer.forward_backward(call.data, call.loss_fn, call.loss_fn_config, call.forward_only)
            if not call.forward_only:
                model.run.forward_backward(result.loss, result.tokens, time.perf_counter() - started)
            metrics = {"loss:sum": result.loss}
            return Outcome(
                json=lambda: wire.forward_backward_json(result, metrics),
                proto=lambda: wire.forward_backward_proto(result, metrics),
            )

        return self._sequenced(model, call.seq_id, "Forward" if call.forward_only else "ForwardBackward", op)

    def optim_step(self, tenant: str, request: types.OptimStepRequest) -> types.UntypedAPIFuture:
        model = self.registry.model(tenant, request.model_id)

        def op() -> Outcome:
            metrics = model.trainer.optim_step(wire.adam_step(request))
            model.run.optim_step(metrics)
            reported = {"grad_norm:mean": metrics["grad_norm"], "learning_rate:mean": metrics["learning_rate"]}
            return Outcome.of(types.OptimStepResponse(metrics=reported).model_dump(mode="json"))

        return self._sequenced(model, request.seq_id, "OptimStep", op)

    def save_weights(self, tenant: str, request: types.SaveWeightsRequest) -> types.UntypedAPIFuture:
        model = self.registry.model(tenant, request.model_id)
        self._admit_checkpoint(tenant)

        def op() -> Outcome:
            path = CheckpointPath.make(model.model_id, "weights", request.path or f"step-{model.trainer.steps:06d}")
            state = model.trainer.state_dict()
            self.store.write(
                tenant,
                path,
                lambda folder: torch.save(state, folder / STATE_FILE),
                request.ttl_seconds,
                request.overwrite,
                request.user_metadata,
                extra={"base_model": model.base},
            )
            model.run.checkpoint(path.uri)
            return Outcome.of(types.SaveWeightsResponse(path=path.uri).model_dump(mode="json"))

        return self._sequenced(model, request.seq_id, "SaveWeights", op)

    def save_weights_for_sampler(
        self, tenant: str, request: types.SaveWeightsForSamplerRequest
    ) -> types.UntypedAPIFuture:
        model = self.registry.model(tenant, request.model_id)
        if request.path is None:
            return self._snapshot_sampler(model, request)
        self._admit_checkpoint(tenant)

        def op() -> Outcome:
            path = CheckpointPath.make(model.model_id, "sampler_weights", request.path)
            meta = {"tinker_model_id": model.model_id, "step": model.trainer.steps}
            self.store.write(
                tenant,
                path,
                lambda folder: self.engine.model(model.base).save(model.adapter, folder, **meta),
                request.ttl_seconds,
                True,
                request.user_metadata,
                extra={"base_model": model.base},
            )
            model.run.checkpoint(path.uri)
            return Outcome.of(types.SaveWeightsForSamplerResponseInternal(path=path.uri).model_dump(mode="json"))

        return self._sequenced(model, request.seq_id, "SaveWeightsForSampler", op)

    def _snapshot_sampler(self, model: TrainingModel, request: types.SaveWeightsForSamplerRequest) -> Any:
        """``save_weights_and_get_sampling_client``: a sampler on a copy of the adapter as it is now."""
        session = self.registry.session(model.tenant, model.session_id)
        sampler = Sampler(
            f"{session.session_id}:sample:{request.sampling_session_seq_id}",
            model.tenant,
            session.session_id,
            model.base,
            adapter=f"s{next(self._names)}",
            source=model,
        )
        self.registry.add_sampler(session, sampler)
        model.snapshots.append(sampler)
        while len(model.snapshots) > SNAPSHOTS_KEPT:
            old = model.snapshots.pop(0)
            self.registry.drop_sampler(old)
            self.engine.call(lambda old=old: self.adapters.release(old))

        def op() -> Outcome:
            self.adapters.snapshot(sampler, model)
            body = types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sampler.sampler_id)
            return Outcome.of(body.model_dump(mode="json"))

        return self._sequenced(model, request.seq_id, "SaveWeightsForSampler", op)

    def load_weights(self, tenant: str, request: types.LoadWeightsRequest) -> types.UntypedAPIFuture:
        if request.weights_access_token:
            raise BadRequest("weights_access_token: loading another account's checkpoints is not supported")
        if request.model_id is not None:
            model = self.registry.model(tenant, request.model_id)
            return self._sequenced(model, request.seq_id, "LoadWeights", lambda: self._load_into(model, request))
        session = self.registry.session(tenant, request.session_id or "")
        self._admit_model(tenant)
        model = self._new_model(session, request.model_seq_id, request.user_metadata)
        future = self.futures.create(tenant, "LoadWeights", model.model_id)

        def op() -> Outcome:
            state = self._training_state(tenant, request.path)
            model.base, model.shape = state["base_model"], AdapterShape(**state["shape"])
            if request.base_model and self.base_of(request.base_model) != model.base:
                raise ValueError(f"base_model: the checkpoint is of {model.base!r}, not {request.base_model!r}")
            self._start(model, seed=0).load_state_dict(state, optimizer=request.optimizer)
            return Outcome.of(
                types.LoadWeightsResponse(path=request.path, model_id=model.model_id).model_dump(mode="json")
            )

        self.engine.submit(self._queue(future, self._or_forget(model, op)))
        return types.UntypedAPIFuture(request_id=future.request_id, model_id=model.model_id)

    def _load_into(self, model: TrainingModel, request: types.LoadWeightsRequest) -> Outcome:
        state = self._training_state(model.tenant, request.path)
        if state["base_model"] != model.base:
            raise ValueError(
                f"path: the checkpoint is of base model {state['base_model']!r}, this model's is {model.base!r}"
            )
        model.trainer.load_state_dict(state, optimizer=request.optimizer)
        return Outcome.of(types.LoadWeightsResponse(path=request.path, model_id=model.model_id).model_dump(mode="json"))

    def _training_state(self, tenant: str, uri: str) -> dict[str, Any]:
        path, folder, _ = self.store.open(tenant, uri)
        if path.kind != "weights":
            raise ValueError(f"path: {uri} holds sampler weights; load a tinker://.../weights/... checkpoint")
        return torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)

    # -- sampling --------------------------------------------------------------------------------------------------
    async def create_sampling_session(
        self, tenant: str, request: types.CreateSamplingSessionRequest
    ) -> types.CreateSamplingSessionResponse:
        session = self.registry.session(tenant, request.session_id)
        sampler_id = f"{session.session_id}:sample:{request.sampling_session_seq_id}"
        if request.model_path is None:
            if request.base_model is None:
                raise BadRequest("create_sampling_session: give model_path or base_model")
            try:
                base = self.base_of(request.base_model)
            except ValueError as error:
                raise BadRequest(str(error)) from error
            self.registry.add_sampler(session, Sampler(sampler_id, tenant, session.session_id, base, None))
            return types.CreateSamplingSessionResponse(sampling_session_id=sampler_id)
        base, folder = sampler_source(self.store, tenant, request.model_path)
        if request.base_model and self.bases.get(request.base_model) != base:
            raise BadRequest(f"base_model: {request.model_path} is of {DISPLAY_NAMES.get(base, base)!r}")
        sampler = Sampler(sampler_id, tenant, session.session_id, base, None, request.model_path)
        self.registry.add_sampler(session, sampler)
        try:
            await asyncio.wrap_future(self.engine.call(lambda: self.adapters.load(sampler, folder)))
        except BaseException:
            session.samplers.pop(sampler_id, None)
            self.registry.samplers.pop(sampler_id, None)
            raise
        return types.CreateSamplingSessionResponse(sampling_session_id=sampler_id)

    def get_sampler(self, tenant: str, sampler_id: str) -> types.GetSamplerResponse:
        sampler = self.registry.sampler(tenant, sampler_id)
        return types.GetSamplerResponse(
            sampler_id=sampler_id,
            base_model=DISPLAY_NAMES.get(sampler.base, sampler.base),
            model_path=sampler.model_path,
        )

    def asample(self, tenant: str, request: types.SampleRequest) -> types.UntypedAPIFuture:
        if not request.sampling_session_id:
            raise BadRequest("sampling_session_id: required (create a sampling client first)")
        sampler = self.registry.sampler(tenant, request.sampling_session_id)
        self._admit(tenant)
        future = self.futures.create(tenant, "Sample", sampler.sampler_id)
        ids = [f"{future.request_id}:{i}" for i in range(request.num_samples)]
        try:
            job = wire.sample_job(request, sampler.adapter)
        except wire.WireError as error:
            self.futures.resolve(future, Outcome.failed(str(error)))
            return types.UntypedAPIFuture(request_id=future.request_id, sample_sequence_ids=ids)
        self.engine.submit(
            Work(
                future,
                job=job,
                base=sampler.base,
                encode=lambda result: Outcome(
                    json=lambda: wire.sample_json(result), proto=lambda: wire.sample_proto(result)
                ),
                after=self._sample_tracker(sampler, future),
            )
        )
        return types.UntypedAPIFuture(request_id=future.request_id, sample_sequence_ids=ids)

    def _sample_tracker(self, sampler: Sampler, future: Future) -> Callable[[Any, float], None] | None:
        if sampler.source is None:
            return None

        def track(result: Any, seconds: float) -> None:
            tokens = sum(len(c.tokens) for c in result.completions)
            if sampler.source.run is not None:
                sampler.source.run.sample(time.monotonic() - future.created, tokens, seconds)

        return track

    # -- registry --------------------------------------------------------------------------------------------------
    async def register_checkpoint(self, tenant: str, uri: str, name: str, alias: str | None) -> dict[str, str]:
        """A sampler checkpoint as a new version of the tenant's registered model ``name`` (logged into the run of
        the client that saved it), so ``opentinker agent serve --llm models:/<tenant>.<name>@<alias>`` serves it."""
        from opentinker.tracking.llm_store import log_adapter_model

        try:
            path, folder, meta = self.store.open(tenant, uri)
        except CheckpointError as error:
            raise NotFound(str(error)) from None
        if path.kind != "sampler_weights":
            raise BadRequest(f"path: register a sampler checkpoint (save_weights_for_sampler), got {uri}")
        if not _MODEL_NAME.match(name):
            raise BadRequest(
                f"model_name: expected 1-100 characters of letters, digits, '.', '_' and '-', got {name!r}"
            )
        registered = tenants.model_name(tenant, name)

        def register() -> str:
            self.tracking.flush()
            client = self.tracking.client(tenant)
            experiment = self.tracking.experiment(client, tenant)
            runs = client.search_runs([experiment], f"tags.`tinker.model_id` = '{path.model_id}'", max_results=1)
            run_id = (
                runs[0].info.run_id if runs else client.create_run(experiment, run_name=f"register-{name}").info.run_id
            )
            tags = {"tinker_path": uri, "base_model": str(meta["base_model"])}
            with _REGISTRY_LOCK:
                version = log_adapter_model(
                    folder, run_id, registered, tags, tenants.tracking_uri(tenant, self.settings)
                )
            if alias:
                client.set_registered_model_alias(registered, alias, version)
            return version

        version = await asyncio.to_thread(register)
        return {"model_name": registered, "version": version, "model_uri": f"models:/{registered}/{version}"}

    # -- futures ---------------------------------------------------------------------------------------------------
    async def retrieve(self, tenant: str, request_id: str, timeout: float) -> Future | None:
        """The future once resolved, None while it is still pending after ``timeout`` seconds; not found: 404."""
        future = self.futures.get(tenant, request_id)
        if future is None:
            raise NotFound(f"request {request_id!r} not found")
        self.registry.touch(future.owner)
        return future if await self.futures.wait(future, timeout) else None
