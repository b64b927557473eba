"""``/api/v1``: the Tinker API as the official ``tinker`` SDK (0.38) calls it (docs/tinker_api.md lists every call).

Every route but ``/api/v1/healthz`` needs a key with the ``tinker`` scope (the SDK sends it as ``X-API-Key``); bodies
are parsed by the SDK's own request models, ``forward_backward`` bodies are its protobuf (decoded by the engine). The
work is ``opentinker.server.tinker.service``'s, in the engine's Ray actor (``tinker.remote``): this module only speaks
HTTP, and holds no model, session or future of its own.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError
from tinker import types

from ..auth import Caller, require_scope
from ..errors import BadRequest, NotFound, OverQuota, ServerError
from ..tinker.actor import EngineActor
from ..tinker.publish import registered_name
from ..tinker.remote import EngineClient

M = TypeVar("M", bound=BaseModel)


class _TinkerRoute(APIRoute):
    """The service's errors as the HTTP answers the SDK acts on (402 billing, 404, 410, 429 back off, ...)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except ServerError as error:
                headers = {"Retry-After": f"{error.retry_after:g}"} if error.retry_after else None
                status = 402 if isinstance(error, OverQuota) else error.status  # the SDK's BillingError
                return JSONResponse({"detail": error.detail}, status_code=status, headers=headers)

        return route


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    """The engine's client; it connects on the first call that needs the engine (the engine outlives the app)."""
    app.state.tinker = EngineClient(app.state.settings)
    yield


router = APIRouter(prefix="/api/v1", tags=["tinker"], route_class=_TinkerRoute, lifespan=_lifespan)
TinkerCaller = Annotated[Caller, Depends(require_scope("tinker"))]


def _service(request: Request) -> EngineClient:
    return request.app.state.tinker


Service = Annotated[EngineClient, Depends(_service)]


async def _parse(request: Request, model: type[M]) -> M:
    """The body as the SDK's request model; a bad one is a 400 naming the field."""
    try:
        return model.model_validate(json.loads(await request.body() or b"{}"))
    except json.JSONDecodeError as error:
        raise BadRequest(f"body: not JSON ({error.msg})") from None
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "body"
        raise BadRequest(f"{field}: {first['msg']}") from None


def _json(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")


# -- client and service -------------------------------------------------------------------------------------------
@router.post("/client/config")
def client_config(request: Request, caller: TinkerCaller) -> dict[str, Any]:
    """Feature flags the SDK reads once: plain httpx, fwd/bwd chunks one after another (they then arrive in sequence
    order) and no larger than the server's body limit, no server-side custom losses or session-wide polling."""
    body_limit = int(request.app.state.settings.server_max_upload_mb * 2**20)
    config = types.ClientConfigResponse(
        use_pyqwest_transport=False,
        parallel_fwdbwd_chunks=False,
        fwdbwd_max_chunk_bytes_count=min(5_000_000, body_limit // 2),
    )
    return _json(config)


@router.post("/client/dynamic_config")
def client_dynamic_config(caller: TinkerCaller) -> dict[str, Any]:
    return _json(types.ClientDynamicConfigResponse())


@router.get("/healthz")
def healthz() -> dict[str, Any]:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
async def get_server_capabilities(service: Service, caller: TinkerCaller) -> dict[str, Any]:
    return _json(await service.call(EngineActor.capabilities))


@router.post("/telemetry")
def telemetry(caller: TinkerCaller) -> dict[str, Any]:
    """The SDK's crash and usage reports: accepted and dropped (this server keeps no telemetry)."""
    return {"status": "accepted"}


@router.get("/usage")
async def usage(service: Service, caller: TinkerCaller) -> dict[str, Any]:
    """OpenTinker's own: the caller's live sessions, training clients, samplers, requests and checkpoint bytes."""
    return await service.call(EngineActor.usage, caller.tenant)  # on the engine's loop: it counts the live futures


# -- sessions -----------------------------------------------------------------------------------------------------
@router.post("/create_session")
async def create_session(request: Request, service: Service, caller: TinkerCaller) -> dict[str, Any]:
    body = await _parse(request, types.CreateSessionRequest)
    return _json(await service.call(EngineActor.create_session, caller.tenant, body))


@router.post("/session_heartbeat")
async def session_heartbeat(request: Request, service: Service, caller: TinkerCaller) -> dict[str, Any]:
    body = await _parse(request, types.SessionHeartbeatRequest)
    return _json(await service.call(EngineActor.heartbeat, caller.tenant, body.session_id))


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, service: Service, caller: TinkerCaller) -> dict[str, Any]:
    await service.call(EngineActor.finish_session, caller.tenant, session_id)
    return {}


@router.post("/sessions/search")
def search_sessions(caller: TinkerCaller) -> dict[str, Any]:
    """SDK 0.38's experimental ``RestClient.search_sessions``: not served (404, the SDK's ``NotFoundError``, as every
    call this server does not serve; without this route the path would be ``GET sessions/{id}``'s, a 405)."""
    raise NotFound("search_sessions is not served here: list_sessions and get_session are")


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, service: Service, caller: TinkerCaller) -> dict[str, Any]:
    return await service.call(EngineActor.session_info, caller.tenant, session_id)


@router.get("/sessions")
async def list_sessions(service: Service, caller: TinkerCaller, limit: int = 20, offset: int = 0) -> dict[str, Any]:
    sessions = await service.call(EngineActor.session_ids, caller.tenant, limit, offset)
    return _json(types.ListSessionsResponse(sessions=sessions))


# -- training -----------------------------------------------------------------------------------------------------
@router.post("/create_model")
async def create_model(request: Request, service: Service, caller: TinkerCaller) -> dict[str, Any]:
    body = await _parse(request, types.CreateModelRequest)
    await service.prepare(caller.tenant)  # a new training client: an MLflow run of the tenant's
    return _json(await service.call(EngineActor.create_model, caller.tenant, body))


@router.post("/get_info")
async def get_info(request: Request, service: Service, caller: TinkerCaller) -> dict[str, Any]:
    body = await _parse(request, types.GetInfoRequest)
    return _json(await service.call(EngineActor.get_info, caller.tenant, body.model_id))


@router.post("/forward_backward")
async def forward_backward(request: Request, service: Service, caller: TinkerCaller) -> dict[str, Any]:
    """A protobuf ``ForwardBackwardRequest`` (``forward_only`` set for ``forward``)."""
    body, encoding = await request.body(), request.headers.get("content-encoding")
    return _json(await service.call(EngineActor.forward_backward, caller.tenant, body, encoding))


@router.post("/optim_step")
async def optim_step(request: Request, service: Service, caller: TinkerCaller) -> dict[str, Any]:
    body = await _parse(request, types.OptimStepRequest)
    return _json(await service.call(EngineActor.optim_step, caller.tenant, body))


@router.post("/save_weights")
async def save_weights(request: Request, service: Service, caller: TinkerCaller) -> dict[str, Any]:
    body = await _parse(request, types.SaveWeightsRequest)
    return _json(await service.call(EngineActor.save_weights, caller.tenant, body))


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request, service: Service, caller: TinkerCaller) -> dict[str, Any]:
    body = await _parse(request, types.SaveWeightsForSamplerRequest)
    return _json(await service.call(EngineActor.save_weights_for_sampler, caller.tenant, body))


@router.post("/load_weights")
async def load_weights(request: Request, service: Service, caller: TinkerCaller) -> dict[str, Any]:
    body = await _parse(request, types.LoadWeightsRequest)
    if body.model_id is None:
        await service.prepare(caller.tenant)  # a new training client: an MLflow run of the tenant's
    return _json(await service.call(EngineActor.load_weights, caller.tenant, body))


# -- sampling -----------------------------------------------------------------------------------------------------
@router.post("/create_sampling_session")
async def create_sampling_session(request: Request, service: Service, caller: TinkerCaller) -> dict[str, Any]:
    body = await _parse(request, types.CreateSamplingSessionRequest)
    return _json(await service.call(EngineActor.create_sampling_session, caller.tenant, body))


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, service: Service, caller: TinkerCaller) -> dict[str, Any]:
    return _json(await service.call(EngineActor.get_sampler, caller.tenant, sampler_id))


@router.post("/asample")
async def asample(request: Request, service: Service, caller: TinkerCaller) -> dict[str, Any]:
    body = await _parse(request, types.SampleRequest)
    return _json(await service.call(EngineActor.asample, caller.tenant, body))


# -- checkpoints --------------------------------------------------------------------------------------------------
@router.get("/training_runs")
async def list_training_runs(
    service: Service, caller: TinkerCaller, limit: int = 20, offset: int = 0
) -> dict[str, Any]:
    """The caller's training runs: live ones, and ended ones while they have a checkpoint that has not expired."""
    runs = await service.call(EngineActor.training_runs, caller.tenant)
    cursor = types.Cursor(offset=offset, limit=limit, total_count=len(runs))
    return {"training_runs": runs[offset : offset + limit], "cursor": _json(cursor)}


@router.get("/training_runs/{model_id}")
async def get_training_run(model_id: str, service: Service, caller: TinkerCaller) -> dict[str, Any]:
    runs = await service.call(EngineActor.training_runs, caller.tenant, model_id)
    if not runs:
        raise NotFound(f"training run {model_id!r} not found")
    return runs[0]


@router.get("/training_runs/{model_id}/checkpoints")
async def list_checkpoints(model_id: str, service: Service, caller: TinkerCaller) -> dict[str, Any]:
    return await service.call(EngineActor.checkpoints, caller.tenant, model_id)


@router.get("/checkpoints")
async def list_user_checkpoints(service: Service, caller: TinkerCaller) -> dict[str, Any]:
    return await service.call(EngineActor.checkpoints, caller.tenant, None)


@router.delete("/training_runs/{model_id}/checkpoints/{kind}/{name}")
async def delete_checkpoint(model_id: str, kind: str, name: str, service: Service, caller: TinkerCaller) -> dict:
    await service.call(EngineActor.delete_checkpoint, caller.tenant, f"tinker://{model_id}/{kind}/{name}")
    return {}


@router.get("/billing/usage/checkpoints/current")
async def checkpoint_storage_usage(
    service: Service, caller: TinkerCaller, project_id: str | None = None
) -> dict[str, Any]:
    """``AdminClient.get_current_checkpoint_storage_usage`` (and ``RestClient``'s deprecated one): the caller's live
    checkpoints, one row for its tenant (there are no projects or prices here)."""
    if project_id is not None:
        raise BadRequest(f"project_id: this server has no projects (omit project_id), got {project_id!r}")
    count, size = await service.call(EngineActor.checkpoint_storage, caller.tenant)
    row = types.CurrentCheckpointStorageUsageItem(
        org_user_urn=f"tenant:{caller.tenant}", checkpoint_count=count, size_bytes=size, size_gigabytes=size / 1e9
    )
    return _json(types.CurrentCheckpointStorageUsageResponse(data=[row]))


class CheckpointSearchCursor(BaseModel):
    """SDK 0.39's ``CheckpointSearchCursor``: where the next page starts (pass ``next_cursor`` back unchanged)."""

    model_config = ConfigDict(extra="forbid")

    last_created_at: AwareDatetime
    last_checkpoint_uuid: str


class CheckpointSearchRequest(BaseModel):
    """SDK 0.39's ``CheckpointSearchRequest`` (its published API reference; the 0.38 SDK has no such type)."""

    model_config = ConfigDict(extra="forbid")

    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = {}
    checkpoint_type: types.CheckpointType | None = None
    owner: types.SearchOwner = types.OwnSearchOwner()
    base_models: list[str] | None = None
    limit: int = Field(50, ge=1, le=200)
    cursor: CheckpointSearchCursor | None = None


@router.post("/checkpoints/search")
async def search_checkpoints(request: Request, service: Service, caller: TinkerCaller) -> dict[str, Any]:
    """SDK 0.39's ``RestClient.search_checkpoints``: the caller's live checkpoints matching every filter, newest
    first, a page at a time. There are no projects here (naming one is an error), and every owner filter sees the
    caller's tenant only: ``own`` and ``accessible`` alike, ``user`` when its URNs name the tenant."""
    body = await _parse(request, CheckpointSearchRequest)
    if body.project_ids:
        raise BadRequest(f"project_ids: this server has no projects (omit project_ids), got {body.project_ids}")
    owner = body.owner
    if body.project_ids == [] or (
        isinstance(owner, types.UserSearchOwner)
        and not {caller.tenant, f"tenant:{caller.tenant}"} & set(owner.owner_urns)
    ):
        return {"checkpoints": [], "next_cursor": None}
    after = None
    if body.cursor is not None:
        try:
            after = int(body.cursor.last_checkpoint_uuid)
        except ValueError:
            raise BadRequest("cursor: not a cursor this server handed out (pass next_cursor back unchanged)") from None
    checkpoints, last = await service.call(
        EngineActor.search_checkpoints,
        caller.tenant,
        body.user_metadata,
        body.checkpoint_type,
        body.base_models,
        body.limit,
        after,
    )
    cursor = None
    if last is not None:
        cursor = {"last_created_at": checkpoints[-1]["time"], "last_checkpoint_uuid": str(last)}
    return {"checkpoints": checkpoints, "next_cursor": cursor}


class WeightsInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tinker_path: str


@router.post("/weights_info")
async def weights_info(request: Request, service: Service, caller: TinkerCaller) -> dict[str, Any]:
    """``RestClient.get_weights_info_by_tinker_path``: the checkpoint's base model and LoRA shape."""
    body = await _parse(request, WeightsInfo)
    return _json(await service.call(EngineActor.weights_info, caller.tenant, body.tinker_path))


class CheckpointTtl(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ttl_seconds: int | None = None


@router.put("/training_runs/{model_id}/checkpoints/{kind}/{name}/ttl")
async def set_checkpoint_ttl(
    model_id: str, kind: str, name: str, request: Request, service: Service, caller: TinkerCaller
) -> dict:
    body = await _parse(request, CheckpointTtl)
    uri = f"tinker://{model_id}/{kind}/{name}"
    await service.call(EngineActor.set_checkpoint_ttl, caller.tenant, uri, body.ttl_seconds)
    return {}


class RegisterCheckpoint(BaseModel):
    """OpenTinker's own: a sampler checkpoint into the tenant's model registry."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="tinker://<model_id>/sampler_weights/<name>")
    model_name: str = Field(description="Registered as <tenant>.<model_name>.")
    alias: str | None = Field(None, description="An alias to point at the new version (e.g. champion).")


@router.post("/register_checkpoint")
async def register_checkpoint(
    request: Request, service: Service, caller: TinkerCaller, _: Annotated[Caller, Depends(require_scope("models"))]
) -> dict[str, Any]:
    """Needs the ``models`` scope too: it writes to the tenant's model registry."""
    body = await _parse(request, RegisterCheckpoint)
    registered = registered_name(caller.tenant, body.model_name)
    await service.prepare(caller.tenant, (registered,))  # made and granted to the tenant first, as a job's model
    return await service.call(EngineActor.register_checkpoint, caller.tenant, body.path, registered, body.alias)


# -- tokenizers ---------------------------------------------------------------------------------------------------
@router.get("/tokenizers/{model_name:path}")
async def get_tokenizer(model_name: str, service: Service, caller: TinkerCaller) -> dict[str, Any]:
    """OpenTinker's own: the tokenizer of a served base model (by any name the API takes) as files, for clients
    without the model hub (``opentinker tinker pull-tokenizer``): ``model_name``, ``revision``, ``files`` (name ->
    base64)."""
    found = await service.call(EngineActor.tokenizer_files, model_name)
    files = {name: base64.b64encode(data).decode() for name, data in found["files"].items()}
    return {"model_name": found["model_name"], "revision": found["revision"], "files": files}


# -- futures ------------------------------------------------------------------------------------------------------
@router.post("/retrieve_future")
async def retrieve_future(request: Request, service: Service, caller: TinkerCaller) -> Response:
    """The result once ready (protobuf when asked and the type has a protobuf form); 408 "try again" with the queue
    state while it is pending; ``{"error", "category"}`` if it failed."""
    body = await _parse(request, types.FutureRetrieveRequest)
    proto = "application/x-protobuf" in request.headers.get("accept", "")
    poll_s = request.app.state.settings.tinker_poll_s
    status, media_type, content = await service.call(
        EngineActor.retrieve, caller.tenant, body.request_id, poll_s, proto
    )
    if media_type == "application/json":
        return JSONResponse(content, status_code=status)
    return Response(content, status_code=status, media_type=media_type)
