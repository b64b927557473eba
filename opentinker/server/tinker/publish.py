"""A sampler checkpoint into the tenant's model registry: the same layout and path as GRPO's adapters, so
``opentinker agent serve --llm models:/<tenant>.<name>@<alias>`` serves what a Tinker client trained.

As for a job's model: the API names it in the tenant's namespace (``registered_name``) and makes the name, granted
to the tenant's MLflow user only, before anything is written (``remote.EngineClient.prepare``, which calls
``models.prepare_store`` as a job's launch does); the engine then logs and registers it with ``log_adapter_model``,
as GRPO jobs do, as the tenant's own MLflow user."""

from __future__ import annotations

import re
import threading
from typing import TYPE_CHECKING

from opentinker.server import tenants

from ..errors import BadRequest, NotFound
from .store import CheckpointError

if TYPE_CHECKING:
    from .core import Core

_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_LOCK = threading.Lock()
"""MLflow's model logging uses its process-wide tracking URI: one registration at a time."""


def registered_name(tenant: str, name: str) -> str:
    """``<tenant>.<name>``, the registered model a client's ``model_name`` means (400 for a bad one)."""
    if not _MODEL_NAME.match(name):
        raise BadRequest(f"model_name: expected 1-100 characters of letters, digits, '.', '_' and '-', got {name!r}")
    return tenants.model_name(tenant, name)


def register_checkpoint(core: Core, tenant: str, uri: str, registered: str, alias: str | None) -> dict[str, str]:
    """Log the checkpoint's adapter folder into the run of the client that saved it (a new run if none) and register
    it as a new version of ``registered`` (``registered_name``, made by the API), ``alias`` pointed at it. Blocking:
    call it off the event loop."""
    from opentinker.tracking.llm_store import log_adapter_model

    if not tenants.owns_model(tenant, registered):
        raise BadRequest(f"model_name: {registered!r} is not in tenant {tenant}'s namespace")
    try:
        path, folder, meta = core.store.open(tenant, uri)
    except CheckpointError as error:
        raise NotFound(str(error)) from None
    if path.kind != "sampler_weights":
        raise BadRequest(f"path: register a sampler checkpoint (save_weights_for_sampler), got {uri}")
    core.tracking.flush()
    client = core.tracking.client(tenant)
    experiment = core.tracking.experiment(client, tenant)
    runs = client.search_runs([experiment], f"tags.`tinker.model_id` = '{path.model_id}'", max_results=1)
    name = registered.removeprefix(tenants.model_prefix(tenant))
    run_id = runs[0].info.run_id if runs else client.create_run(experiment, run_name=f"register-{name}").info.run_id
    tags = {"tinker_path": uri, "base_model": str(meta["base_model"])}
    with _LOCK:
        version = log_adapter_model(folder, run_id, registered, tags, core.tracking.uri(tenant))
    if alias:
        client.set_registered_model_alias(registered, alias, version)
    return {"model_name": registered, "version": version, "model_uri": f"models:/{registered}/{version}"}
