"""A sampler checkpoint into the tenant's model registry: the same layout and path as GRPO's adapters, so
``opentinker agent serve --llm models:/<tenant>.<name>@<alias>`` serves what a Tinker client trained."""

from __future__ import annotations

import re
import threading

from opentinker.server import tenants

from ..errors import BadRequest, NotFound
from .core import Core
from .store import CheckpointError

_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_LOCK = threading.Lock()
"""MLflow's model logging uses its process-wide tracking URI: one registration at a time."""


def register_checkpoint(core: Core, tenant: str, uri: str, name: str, alias: str | None) -> dict[str, str]:
    """Log the checkpoint's adapter folder into the run of the client that saved it (a new run if none) and register
    it as a new version of ``<tenant>.<name>``, ``alias`` pointed at it. Blocking: call it off the event loop."""
    from opentinker.tracking.llm_store import log_adapter_model

    try:
        path, folder, meta = core.store.open(tenant, uri)
    except CheckpointError as error:
        raise NotFound(str(error)) from None
    if path.kind != "sampler_weights":
        raise BadRequest(f"path: register a sampler checkpoint (save_weights_for_sampler), got {uri}")
    if not _MODEL_NAME.match(name):
        raise BadRequest(f"model_name: expected 1-100 characters of letters, digits, '.', '_' and '-', got {name!r}")
    registered = tenants.model_name(tenant, name)
    core.tracking.flush()
    client = core.tracking.client(tenant)
    experiment = core.tracking.experiment(client, tenant)
    runs = client.search_runs([experiment], f"tags.`tinker.model_id` = '{path.model_id}'", max_results=1)
    run_id = runs[0].info.run_id if runs else client.create_run(experiment, run_name=f"register-{name}").info.run_id
    tags = {"tinker_path": uri, "base_model": str(meta["base_model"])}
    with _LOCK:
        version = log_adapter_model(folder, run_id, registered, tags, tenants.tracking_uri(tenant, core.settings))
    if alias:
        client.set_registered_model_alias(registered, alias, version)
    return {"model_name": registered, "version": version, "model_uri": f"models:/{registered}/{version}"}
