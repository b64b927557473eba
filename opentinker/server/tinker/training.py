"""Training clients: ``create_model``, ``get_info``, ``forward_backward`` / ``forward``, ``optim_step``,
``save_weights`` (``save_state``), ``load_weights`` and ``save_weights_for_sampler``.

A model is ``<session>:train:<model_seq_id>``: an adapter on the shared base model with its own AdamW state
(``agents.adapter_trainer``) and an MLflow run. Every operation after ``create_model`` runs on the worker in the
model's sequence order.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from tinker import types

from opentinker.agents.adapter_trainer import AdapterTrainer, ForwardResult, Part
from opentinker.agents.multi_lora import AdapterShape

from ..errors import BadRequest
from . import stability, wire
from .core import STATE_FILE, Core
from .engine import TrainPart
from .futures import Outcome
from .records import TinkerTrainingRun
from .sampling import Sampling
from .sessions import Sequencer, Session, TrainingModel
from .store import CheckpointPath


def _json(response: Any) -> Outcome:
    return Outcome.of(response.model_dump(mode="json"))


class Training:
    def __init__(self, core: Core, sampling: Sampling):
        self.core, self.sampling = core, sampling

    # -- creating a model ------------------------------------------------------------------------------------------
    def create_model(self, tenant: str, request: types.CreateModelRequest) -> types.UntypedAPIFuture:
        def build(model: TrainingModel) -> Outcome:
            model.base = self.core.base_of(request.base_model)
            if request.optimizer_config.type != "adamw":
                raise ValueError(f"optimizer_config: only adamw is supported, got {request.optimizer_config.type!r}")
            lora = request.lora_config or types.LoraConfig(rank=32)
            model.shape = AdapterShape(lora.rank, lora.train_attn, lora.train_mlp, lora.train_unembed)
            self._start(model, seed=lora.seed)
            return _json(types.CreateModelResponse(model_id=model.model_id))

        return self._create(tenant, request.session_id, request, "CreateModel", build)

    def _create(
        self,
        tenant: str,
        session_id: str,
        request: types.CreateModelRequest | types.LoadWeightsRequest,
        kind: str,
        build: Callable[[TrainingModel], Outcome],
    ) -> types.UntypedAPIFuture:
        """A new model's first request (``CreateModel``, or ``LoadWeights`` from a checkpoint): a resend gets the first
        request's future; otherwise the model is admitted against the tenant's quota and ``build`` runs on the
        engine (a model it does not start is forgotten)."""
        core = self.core
        session = core.registry.session(tenant, session_id)
        if (earlier := self._creation(session, request.model_seq_id)) is not None:
            return earlier
        core.admit_model(tenant)
        model = self._new_model(session, request.model_seq_id, request.user_metadata)
        future = model.creation = core.futures.create(tenant, kind, model.model_id, session.session_id)
        core.engine.submit(core.work(future, self._or_forget(model, lambda: build(model))))
        return types.UntypedAPIFuture(request_id=future.request_id, model_id=model.model_id)

    @staticmethod
    def _creation(session: Session, model_seq_id: int | None) -> types.UntypedAPIFuture | None:
        """The future of the request that already created this model, when the SDK sends its creation again."""
        model = session.models.get(f"{session.session_id}:train:{model_seq_id}")
        if model is None or model.creation is None:
            return None
        return types.UntypedAPIFuture(request_id=model.creation.request_id, model_id=model.model_id)

    def _new_model(self, session: Session, model_seq_id: int | None, metadata: dict | None) -> TrainingModel:
        if model_seq_id is None:
            raise BadRequest("model_seq_id: required")
        model = TrainingModel(
            model_id=f"{session.session_id}:train:{model_seq_id}",
            tenant=session.tenant,
            session_id=session.session_id,
            base="",
            shape=AdapterShape(),
            adapter=self.core.adapter_name("m"),
            sequencer=Sequencer(),
            user_metadata=metadata,
        )
        self.core.registry.add_model(session, model)
        return model

    def _or_forget(self, model: TrainingModel, op: Callable[[], Outcome]) -> Callable[[], Outcome]:
        """``op``, after which a model that did not start is dropped (its quota slot released, its run ended)."""

        def run() -> Outcome:
            outcome = None
            try:
                outcome = op()
                return outcome
            finally:
                if model.trainer is None or outcome is None or outcome.error:
                    model.closed = True
                    self.core.records.end_run(model.model_id)

        return run

    def _start(self, model: TrainingModel, seed: int | None) -> AdapterTrainer:
        """On the worker: the model's adapter and optimiser, and its MLflow run."""
        core = self.core
        model.trainer = AdapterTrainer(core.engine.model(model.base), model.adapter, model.shape, seed)
        params = {"base_model": core.display(model.base), "lora_rank": model.shape.rank, **vars(model.shape)}
        tags = {"tinker.model_id": model.model_id, "tinker.session_id": model.session_id}
        model.run = core.tracking.start_run(model.tenant, f"tinker-{model.model_id}", params, tags)
        core.tracking.flush()  # the run exists before the client hears of its model (its store, too, on first use)
        core.records.add_run(
            TinkerTrainingRun(
                model_id=model.model_id,
                tenant=model.tenant,
                session_id=model.session_id,
                base_model=model.base,
                lora_rank=model.shape.rank,
                shape=dataclasses.asdict(model.shape),
                user_metadata=model.user_metadata,
            )
        )
        return model.trainer

    def get_info(self, tenant: str, model_id: str) -> types.GetInfoResponse:
        model = self.core.model(tenant, model_id)
        name = self.core.display(model.base)
        data = types.ModelData(arch="llama", model_name=name, tokenizer_id=self.core.tokenizers.get(model.base))
        return types.GetInfoResponse(
            model_id=model_id, model_data=data, is_lora=True, lora_rank=model.shape.rank, model_name=name
        )

    # -- the training loop -----------------------------------------------------------------------------------------
    def forward_backward(self, tenant: str, call: wire.ForwardBackwardCall) -> types.UntypedAPIFuture:
        """Queued as a ``TrainPart``: the worker may run it in one pass with other clients' (``engine``)."""
        core = self.core
        model = core.model(tenant, call.model_id)
        session = core.registry.sessions[model.session_id]

        def prepare() -> Part:
            core.ready(model)
            data = call.data
            if call.loss_fn == "stable_reinforce":  # the sampler's recorded logprobs, checked against the datums
                data = stability.resolve(call.data, call.provenance, session.stability)
            resolved = model.trainer.check(data, call.loss_fn, call.loss_fn_config)
            return Part(model.trainer, data, call.loss_fn, resolved)

        def finish(result: ForwardResult, seconds: float) -> Outcome:
            if not call.forward_only:
                model.run.forward_backward(result.loss, result.tokens, seconds)
            metrics = {"loss:sum": result.loss}
            return Outcome(
                json=lambda: wire.forward_backward_json(result, metrics),
                proto=lambda: wire.forward_backward_proto(result, metrics),
            )

        kind = "Forward" if call.forward_only else "ForwardBackward"
        return core.sequenced(model, call.seq_id, kind, TrainPart(prepare, finish, call.forward_only))

    def optim_step(self, tenant: str, request: types.OptimStepRequest) -> types.UntypedAPIFuture:
        model = self.core.model(tenant, request.model_id)

        def op() -> Outcome:
            metrics = model.trainer.optim_step(wire.adam_step(request))
            model.run.optim_step(metrics)
            reported = {"grad_norm:mean": metrics["grad_norm"], "learning_rate:mean": metrics["learning_rate"]}
            return _json(types.OptimStepResponse(metrics=reported))

        return self.core.sequenced(model, request.seq_id, "OptimStep", op)

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def save_weights(self, tenant: str, request: types.SaveWeightsRequest) -> types.UntypedAPIFuture:
        core = self.core
        model = core.model(tenant, request.model_id)

        def op() -> Outcome:
            path = CheckpointPath.make(model.model_id, "weights", request.path or f"step-{model.trainer.steps:06d}")
            state = model.trainer.state_dict()
            core.store.write(
                tenant,
                path,
                lambda folder: torch.save(state, folder / STATE_FILE),
                model.base,
                request.ttl_seconds,
                request.overwrite,
                request.user_metadata,
            )
            model.run.checkpoint(path.uri)
            return _json(types.SaveWeightsResponse(path=path.uri))

        admit = functools.partial(core.admit_checkpoint, tenant)
        return core.sequenced(model, request.seq_id, "SaveWeights", op, admit)

    def save_weights_for_sampler(
        self, tenant: str, request: types.SaveWeightsForSamplerRequest
    ) -> types.UntypedAPIFuture:
        """Named: a peft adapter folder on the store (what sampling clients and the registry read). Unnamed
        (``save_weights_and_get_sampling_client``): a sampler on a snapshot of the adapter."""
        core = self.core
        model = core.model(tenant, request.model_id)
        if request.path is None:
            return self.sampling.snapshot(model, request)

        def op() -> Outcome:
            path = CheckpointPath.make(model.model_id, "sampler_weights", request.path)
            meta = {"tinker_model_id": model.model_id, "step": model.trainer.steps}
            core.store.write(
                tenant,
                path,
                lambda folder: core.engine.model(model.base).save(model.adapter, folder, **meta),
                model.base,
                request.ttl_seconds,
                True,
                request.user_metadata,
            )
            model.run.checkpoint(path.uri)
            return _json(types.SaveWeightsForSamplerResponseInternal(path=path.uri))

        admit = functools.partial(core.admit_checkpoint, tenant)
        return core.sequenced(model, request.seq_id, "SaveWeightsForSampler", op, admit)

    def load_weights(self, tenant: str, request: types.LoadWeightsRequest) -> types.UntypedAPIFuture:
        """Into an existing model (the SDK's ``load_state``), or as a new model's first request
        (``create_training_client_from_state[_with_optimizer]``: ``session_id`` + ``model_seq_id``)."""
        core = self.core
        if request.weights_access_token:
            raise BadRequest("weights_access_token: loading another account's checkpoints is not supported")
        if request.model_id is not None:
            model = core.model(tenant, request.model_id)
            return core.sequenced(model, request.seq_id, "LoadWeights", lambda: self._load_into(model, request))

        def build(model: TrainingModel) -> Outcome:
            state = self._training_state(tenant, request.path)
            model.base, model.shape = state["base_model"], AdapterShape(**state["shape"])
            if request.base_model and core.base_of(request.base_model) != model.base:
                raise ValueError(f"base_model: the checkpoint is of {model.base!r}, not {request.base_model!r}")
            self._start(model, seed=0).load_state_dict(state, optimizer=request.optimizer)
            return _json(types.LoadWeightsResponse(path=request.path, model_id=model.model_id))

        return self._create(tenant, request.session_id or "", request, "LoadWeights", build)

    def _load_into(self, model: TrainingModel, request: types.LoadWeightsRequest) -> Outcome:
        state = self._training_state(model.tenant, request.path)
        if state["base_model"] != model.base:
            raise ValueError(f"path: the checkpoint is of {state['base_model']!r}, this model's base is {model.base!r}")
        model.trainer.load_state_dict(state, optimizer=request.optimizer)
        return _json(types.LoadWeightsResponse(path=request.path, model_id=model.model_id))

    def _training_state(self, tenant: str, uri: str) -> dict[str, Any]:
        path, folder, _ = self.core.store.open(tenant, uri)
        if path.kind != "weights":
            raise ValueError(f"path: {uri} holds sampler weights; load a tinker://.../weights/... checkpoint")
        return torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
