"""The policy as an HTTP service: ``bentoml serve opentinker.serving.policy_service:PolicyService``.

Configured by ``OPENTINKER_SERVE_*`` (``serving.config.ServeSettings``): which model to serve
(``models:/NAME@champion`` by default), the API-key hash, limits and the alias poll interval.

Endpoints (all POST, JSON, ``Authorization: Bearer <key>``; only ``/healthz``, ``/livez``, ``/readyz`` are open):
``/act`` one observation -> action (+ probabilities and value with ``return_info``); ``/act_batch``
many observations -> actions, merged across concurrent requests by BentoML's adaptive batching;
``/metadata``; ``/reload`` re-resolves the alias now. Every response carries ``X-Model-Version``.

Observations are validated against the served policy's observation space before any batching, so
one bad request gets its own 400 and never fails the requests it would have been merged with. A Dict observation is
a JSON object (one entry per key), a Tuple one a JSON array of its parts, an image nested lists of integers; a policy
whose single observation could not fit in the request body limit is refused at start.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

import bentoml
import numpy as np
from pydantic import AfterValidator, BaseModel, Field, WithJsonSchema

from opentinker.agents.export import space_to_json
from opentinker.envs.observations import map_obs

from .auth import ApiKeyMiddleware
from .config import get_serve_settings
from .middleware import BodyLimitMiddleware, JsonBodyMiddleware, ResponseHeaderMiddleware
from .model_slot import AliasWatcher, ModelSlot, load_served_model
from .observation import check_request_limit

logger = logging.getLogger("opentinker.serving")
SETTINGS = get_serve_settings()
SLOT = ModelSlot()
"""This worker's served policy; request validators read its schema (they run before the service method)."""
VERSION_HEADER = "X-Model-Version"


def _check_observation(value: Any) -> np.ndarray:
    return SLOT.require().schema.validate(value)


def _check_batch(value: Any) -> np.ndarray:
    return SLOT.require().schema.validate(value, batched=True, max_rows=SETTINGS.max_batch_size)


Observation = Annotated[
    Any,
    AfterValidator(_check_observation),
    WithJsonSchema(
        {"description": "One observation: a number or nested lists matching the observation space (see /metadata)."}
    ),
]
ObservationBatch = Annotated[
    Any,
    AfterValidator(_check_batch),
    WithJsonSchema(
        {
            "type": "array",
            "items": {},
            "description": "A list of observations, each matching the observation space (see /metadata).",
        }
    ),
]


class ActResponse(BaseModel):
    action: Any = Field(description="The action for the observation (an int for discrete action spaces, else a list).")
    model_version: str = Field(description="The registered version that computed the action.")
    probs: list[float] = Field(
        default_factory=list,
        description="Action probabilities with return_info (discrete actor-critic policies); else empty.",
    )
    value: float | None = Field(None, description="State value estimate (with return_info).")


@bentoml.service(
    name="opentinker_policy",
    workers=SETTINGS.workers,
    traffic={"timeout": SETTINGS.timeout_s, "max_concurrency": SETTINGS.max_concurrency},
    logging={"access": {"enabled": SETTINGS.access_log}},
    metrics={"enabled": SETTINGS.metrics},
    tracing={} if SETTINGS.tracing else {"excluded_urls": [".*"]},
)
class PolicyService:
    """Loads the configured policy version at start and follows its alias while running."""

    def __init__(self) -> None:
        served = load_served_model(SETTINGS.model)
        check_request_limit(served.schema, SETTINGS.max_body_bytes)
        SLOT.current = served
        logger.info("serving %s version %s from %s", served.ref.name, served.version, SETTINGS.model)
        self.watcher = AliasWatcher(SLOT, SETTINGS.model, SETTINGS.reload_interval_s)
        self.watcher.start()

    def __is_ready__(self) -> bool:
        return SLOT.current is not None

    @bentoml.on_shutdown
    def _stop_watcher(self) -> None:
        self.watcher.stop()

    @bentoml.api
    async def act(self, obs: Observation, ctx: bentoml.Context, return_info: bool = False) -> ActResponse:
        """The action for one observation: greedy, or drawn from the policy where its export says it serves sampled
        actions (the gate judged that)."""
        served = SLOT.require()
        ctx.response.headers[VERSION_HEADER] = served.version
        batch = map_obs(lambda leaf: leaf[None], obs)
        if not return_info:
            return ActResponse(action=served.policy.act(batch)[0].tolist(), model_version=served.version)
        actions, probs, values = served.policy.act_with_info(batch)
        return ActResponse(
            action=actions[0].tolist(),
            model_version=served.version,
            probs=[] if probs is None else probs[0].tolist(),
            value=None if values is None else float(values[0]),
        )

    @bentoml.api(batchable=True, max_batch_size=SETTINGS.max_batch_size, max_latency_ms=SETTINGS.max_latency_ms)
    async def act_batch(self, obs: ObservationBatch) -> np.ndarray:
        """Actions for a list of observations; concurrent requests are merged into one forward pass (Dict/Tuple
        observations arrive as a list of them, which the policy stacks)."""
        return SLOT.require().policy.act(obs)

    @bentoml.api
    async def metadata(self) -> dict[str, Any]:
        """What is being served: model name, version, alias, run id, env, spaces, reload state."""
        served = SLOT.require()
        spec = getattr(served.policy, "spec", {}) or {}
        return {
            "model_uri": served.ref.uri,
            "model_name": served.ref.name,
            "model_version": served.version,
            "alias": served.ref.alias,
            "run_id": served.ref.run_id,
            "env_id": spec.get("env_id"),
            "algorithm": spec.get("algorithm"),
            "served_action": served.policy.served_action,
            "observation_space": {"repr": str(served.policy.observation_space), **served.schema.describe()},
            "action_space": {"repr": str(served.policy.action_space), **space_to_json(served.policy.action_space)},
            "loaded_at": served.loaded_at,
            "reload_interval_s": SETTINGS.reload_interval_s,
            "last_reload_error": SLOT.last_error,
            "max_batch_size": SETTINGS.max_batch_size,
            "max_body_bytes": SETTINGS.max_body_bytes,
        }

    @bentoml.api
    async def reload(self) -> dict[str, Any]:
        """Resolve the model URI again; swap in a new version if it moved (requests in flight finish on the old one)."""
        import anyio.to_thread

        return await anyio.to_thread.run_sync(lambda: self.watcher.check_now(force=True))


# Outermost first: every response (401/413 included) is labelled, auth runs before the body is read.
PolicyService.add_asgi_middleware(ResponseHeaderMiddleware, name=VERSION_HEADER, value_fn=SLOT.version)
PolicyService.add_asgi_middleware(ApiKeyMiddleware)
PolicyService.add_asgi_middleware(BodyLimitMiddleware, max_bytes=SETTINGS.max_body_bytes)
PolicyService.add_asgi_middleware(JsonBodyMiddleware)
