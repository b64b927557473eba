"""The API's side of the Tinker engine: where its Ray is, and the named actor (``actor.EngineActor``) calls go to.

The engine runs on ``tinker_ray_address`` (the operator's cluster, which jobs never get), else ``ray_address``, when
one is configured; otherwise on a local Ray head that the first API process needing it starts as a process of its own
(``<data_dir>/server/ray``, one ``ray start --block`` process group), so a SIGKILL of the API leaves it, and the
actor, running. The actor is named, detached, in a namespace of the data dir:
an API started again on the same data dir (or a second API on it) finds the same actor and serves the same clients.
The head's record (``state.json``) has one writer: the API process that started the head removes it when it stops
normally (``stop_local_ray``), and ``opentinker server down`` does; any other API that stops leaves head and engine
to the APIs still using them (on this machine or, sharing the data dir, another).

The engine gets least privilege: it runs no tenant code, but its state can be read by whoever reaches its Ray (any
driver on a configured cluster), so it is handed none of the operator's credentials (``OPERATOR_SETTINGS``, withheld
from the local head's environment too). What needs them is done here, in the API: before a call that writes to a
tenant's MLflow (a training client's run, a registered checkpoint) ``EngineClient.prepare`` makes the tenant's
store, experiment and model names as for a job (``models.tenant_writer``) and hands the engine that tenant's own
MLflow user, with which every write of the engine for that tenant is made (and which MLflow confines to the tenant).
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import signal
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from opentinker.infra.cluster import LocalCluster
from opentinker.infra.settings import Settings

from ..errors import Forbidden, ServerError
from .actor import EngineActor

P = ParamSpec("P")
R = TypeVar("R")

ACTOR_NAME = "tinker-engine"
OPERATOR_SETTINGS = (
    "s3_access_key",
    "s3_secret_key",
    "s3_admin_access_key",
    "s3_admin_secret_key",
    "s3_tenant_secret",
    "mlflow_admin_username",
    "mlflow_admin_password",
    "mlflow_tenant_secret",
)
"""The operator's S3 and MLflow credentials (and the secrets tenants' are derived from): the engine is never handed
them. It writes no object to S3 (its MLflow artifacts go where the tenant's experiment keeps them); the API makes
each tenant's MLflow user, experiment and names, and hands the engine that user (``EngineClient.prepare``)."""
OPERATOR_VARIABLES = (
    *(f"OPENTINKER_{name.upper()}" for name in OPERATOR_SETTINGS),
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
)
"""The same in an environment (and boto3's and MLflow's own: MLflow's would override a tenant's user in the URI),
withheld from the local Ray head the engine runs on."""
MAX_CONCURRENCY = 1000
"""Calls the actor's event loop holds at once (long-polls of ``retrieve_future`` among them)."""


class EngineUnavailable(ServerError):
    """The engine's actor died (it is started again on the next call): the SDK retries a 503."""

    status = 503


def namespace(settings: Settings) -> str:
    """The Ray namespace of a data dir's Tinker engine: servers on one data dir share it, others never do."""
    return "opentinker-" + hashlib.sha1(str(settings.resolved_data_dir).encode()).hexdigest()[:12]


def local_ray(settings: Settings) -> LocalCluster:
    """The local Ray head the server starts when no ``ray_address`` is configured."""
    return LocalCluster(settings.resolved_data_dir / "server" / "ray", settings)


def ray_address(settings: Settings) -> str:
    """The configured Ray address, else the local head's (started, under a file lock, when none runs)."""
    configured = settings.tinker_ray_address or settings.ray_address or os.environ.get("RAY_ADDRESS")
    if configured:
        return configured
    cluster = local_ray(settings)
    cluster.root.mkdir(parents=True, exist_ok=True)
    with open(cluster.root / "start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two APIs starting at once: one head
        if cluster.address:
            return cluster.address
        cpus = settings.ray_num_cpus or os.cpu_count()
        address = cluster.up(nodes=1, cpus_per_node=cpus, gpus=None, env=dict.fromkeys(OPERATOR_VARIABLES))
        _started[cluster.root] = _head(cluster)
        return address


_started: dict[Path, tuple[int, float] | None] = {}
"""The local Ray heads this process started (pid, start time), by folder: the only ones its own stop ends."""


def _head(cluster: LocalCluster) -> tuple[int, float] | None:
    head = cluster.nodes().get("head")
    return (head.pid, head.create_time) if head else None


def _keep_sigterm() -> None:
    """Put the process's own SIGTERM handler back over the native one Ray's driver installs, which ends the process at
    once: uvicorn's graceful stop, after which ``up`` stops its embedded stack (this Ray head among it). Python sets
    handlers on the main thread only (where the API's event loop runs)."""
    if threading.current_thread() is threading.main_thread():
        handler = signal.getsignal(signal.SIGTERM)
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)


class EngineClient:
    """One per API process: connects to Ray and the actor on first use, then forwards calls."""

    def __init__(self, settings: Settings):
        self.settings = settings.model_copy(update={"data_dir": settings.resolved_data_dir})  # the actor's cwd differs
        self._actor: Any = None
        self._lock = asyncio.Lock()

    async def actor(self) -> Any:
        async with self._lock:
            if self._actor is None:
                self._actor = await asyncio.to_thread(self._connect)
                _keep_sigterm()
            return self._actor

    def _connect(self) -> Any:
        import ray

        if not ray.is_initialized():
            ray.init(address=ray_address(self.settings), namespace=namespace(self.settings), log_to_driver=False)
        device = self.settings.tinker_device
        gpu = device.startswith("cuda") or (device == "auto" and ray.cluster_resources().get("GPU", 0) >= 1)
        update = dict.fromkeys(OPERATOR_SETTINGS, "")
        if gpu:  # Ray picks the GPU and makes it the actor's only visible one: "cuda:1" would name none there.
            update["tinker_device"] = "cuda"
        settings = self.settings.model_copy(update=update)
        actor = (
            ray.remote(EngineActor)
            .options(
                name=ACTOR_NAME,
                namespace=namespace(self.settings),
                lifetime="detached",
                get_if_exists=True,
                max_concurrency=MAX_CONCURRENCY,
                num_cpus=1,
                num_gpus=1 if gpu else 0,
            )
            .remote(settings)
        )
        ray.get(actor.ready.remote())
        return actor

    async def call(
        self, method: Callable[Concatenate[EngineActor, P], Awaitable[R]], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """``method`` of the engine's actor (``EngineActor.create_model``: a method, so a wrong name or argument fails
        where it is written); its ``ServerError`` re-raised here (the route answers it), a dead actor a 503."""
        from ray.exceptions import RayActorError, RayTaskError

        actor = await self.actor()
        try:
            return await getattr(actor, method.__name__).remote(*args, **kwargs)
        except RayTaskError as error:
            if isinstance(error.cause, ServerError):
                raise error.cause from None
            raise
        except RayActorError as error:
            async with self._lock:
                if self._actor is actor:
                    self._actor = None  # the next call makes a new one
            raise EngineUnavailable(f"the Tinker engine stopped ({error.error_msg}); retry") from None

    async def prepare(self, tenant: str, model_names: tuple[str, ...] = ()) -> None:
        """Before a call that writes to the tenant's MLflow: its store, experiment and ``model_names`` made here as
        for a job (``models.tenant_writer``; a name another MLflow user made first: 403), and the tenant's own
        MLflow user handed to the engine. Every time, not once: a new engine (the old one died) starts with none."""
        from .. import mlflow_users
        from ..models import tenant_writer

        try:
            user = await asyncio.to_thread(tenant_writer, tenant, self.settings, model_names)
        except mlflow_users.NameTaken as error:
            raise Forbidden(str(error)) from None
        await self.call(EngineActor.set_tracking_user, tenant, user)


STOP_TIMEOUT_S = 5.0
"""How long the local Ray head gets to stop on SIGTERM before it is killed: ``ray start --block`` can take longer
than the API's own stop allows, and the engine has nothing to save (its state goes with it either way)."""


def stop_local_ray(settings: Settings, started_here: bool = False) -> list[str]:
    """Stop the local Ray head (and the engine on it), if this data dir's server started one; ``started_here`` (an
    API stopping): only the head this process started, which another API on the data dir may not end."""
    cluster = local_ray(settings)
    if not cluster.state_path.exists():
        return []
    if started_here and (cluster.root not in _started or _started[cluster.root] != _head(cluster)):
        return []
    return [f"tinker ray {name}" for name in cluster.down(STOP_TIMEOUT_S)]


__all__ = ["EngineClient", "EngineUnavailable", "namespace", "ray_address", "stop_local_ray"]
