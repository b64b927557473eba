"""A tenant's registered models: downloaded for the SDK, served behind the tenant's keys.

MLflow keeps one tracking and registry location per process, so reads of a tenant's store go through
``tenant_mlflow`` (a lock while MLflow points at that tenant). A policy service is the project's own BentoML service
(``serving/policy_service.py``: numpy forward pass, no user code) started for one registered version; it accepts the
key the user chose (only its hash reaches the server) and a key of the server's own, with which the server forwards
``POST /v1/services/{id}/act`` from any key of the tenant.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import sqlalchemy as sa

from opentinker.infra.processes import ServiceProcess
from opentinker.infra.settings import Settings

from . import mlflow_users, tenants
from .db import Job, Service, Store

_mlflow_lock = threading.Lock()
_ready: set[str] = set()


def prepare_store(tenant: str, settings: Settings, model_names: tuple[str, ...] = ()) -> None:
    """The tenant's MLflow store and experiment, made before its first job starts (once per process): two first jobs
    would otherwise create the same SQLite store at once, and MLflow's schema migrations do not survive that race.
    On an MLflow server with its authentication app (``mlflow_users``): the tenant's user, its experiment and the
    job's registered models ``model_names``, made by the server's admin and granted to the tenant's user only."""
    import mlflow

    from opentinker.tracking.runs import EXPERIMENT_KIND

    if mlflow_users.enabled(settings):
        identities = mlflow_users.identities(settings)
        identities.ensure_experiment(tenant)
        for name in model_names:
            identities.ensure_model(tenant, name)
        return
    uri = tenants.tracking_uri(tenant, settings)
    with _mlflow_lock:
        if uri in _ready:
            return
        if uri.startswith("sqlite:///"):
            tenants.data_dir(tenant, settings).mkdir(parents=True, exist_ok=True)
        client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
        name = tenants.experiment(tenant)
        if client.get_experiment_by_name(name) is None:
            location = None if uri.startswith("http") else (tenants.data_dir(tenant, settings) / "artifacts").as_uri()
            client.create_experiment(name, artifact_location=location, tags=dict([EXPERIMENT_KIND]))
        _ready.add(uri)


def tenant_writer(
    tenant: str, settings: Settings, model_names: tuple[str, ...] = ()
) -> mlflow_users.Credentials | None:
    """What a process writing for ``tenant`` alone (a job's attempt, the Tinker engine) is handed, once this trusted
    one has made the tenant's store, experiment and ``model_names`` (``prepare_store``): the tenant's own MLflow user,
    or None without MLflow users. ``mlflow_users.NameTaken`` when one of them is another MLflow user's."""
    prepare_store(tenant, settings, model_names)
    return mlflow_users.credentials(tenant, settings) if mlflow_users.enabled(settings) else None


def tenant_credentials(tenant: str, settings: Settings) -> dict[str, str]:
    """The MLflow client variables of a process acting for ``tenant`` alone (an attempt, a policy service): its
    own MLflow user on a server with the authentication app, else nothing."""
    if not mlflow_users.enabled(settings):
        return {}
    creds = mlflow_users.credentials(tenant, settings)
    return {"MLFLOW_TRACKING_USERNAME": creds.username, "MLFLOW_TRACKING_PASSWORD": creds.password}


@contextlib.contextmanager
def tenant_mlflow(tenant: str, settings: Settings) -> Iterator[object]:
    """``mlflow`` pointed at the tenant's tracking store and registry for the duration of the block; on an MLflow
    server with users, as the tenant's user (its credentials in the URI: the process's environment stays as it is)."""
    from opentinker.tracking.runs import mlflow_at

    uri = tenants.tracking_uri(tenant, settings)
    if mlflow_users.enabled(settings):
        uri = mlflow_users.uri_with(uri, mlflow_users.credentials(tenant, settings))
    with _mlflow_lock, mlflow_at(uri) as mlflow:
        yield mlflow


def not_a_policy(job: Job) -> str | None:
    """Why a finished job has no numpy policy to download or serve, or None: a GRPO job registers a LoRA adapter,
    which the server's policy services (numpy forward pass) cannot run; a group one model per agent kind."""
    kinds = job.result.kinds if job.result else {}
    if kinds:
        models = ", ".join(f"{k.model_name} v{k.model_version}" for k in kinds.values())
        return f"job {job.id} trained a group: one model per agent kind ({models}), not one policy"
    if job.spec.algorithm != "grpo":
        return None
    return (
        f"job {job.id} trained a language-model adapter ({job.result.model_name} v{job.result.model_version}), "
        "not a policy: the server serves policies only; serve the adapter with `opentinker agent serve --llm`"
    )


def policy_archive(job: Job, settings: Settings) -> BinaryIO:
    """The finished job's registered policy (its format's files: ``policy.json`` + ``weights.npz``) as a ``.tar.gz``,
    an open file whose name is already removed: it is written to disk and read back in chunks, so the API's memory
    stays flat whatever the export's size, and nothing is left behind however the download ends."""
    from opentinker.tracking.registry import POLICY_FILE

    from .channel import POLICY_FILES

    uri = f"models:/{job.result.model_name}/{job.result.model_version}"
    with tempfile.TemporaryDirectory(prefix="opentinker-policy-") as tmp:
        with tenant_mlflow(job.tenant, settings) as mlflow:
            model_dir = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=tmp))
        export = sorted(model_dir.glob(f"**/{POLICY_FILE}"))[0].parent
        handle = tempfile.TemporaryFile(dir=tmp)  # unlinked at once; the open file keeps its bytes
        try:
            # Stored, not deflated: weights hardly compress (~10 %), and deflating a GiB would take the API a minute.
            with tarfile.open(fileobj=handle, mode="w:gz", compresslevel=0) as archive:
                for name in sorted(POLICY_FILES):
                    archive.add(export / name, arcname=name)
            handle.seek(0)
        except BaseException:
            handle.close()
            raise
    return handle


class Services:
    """Starts, finds and stops the tenants' policy services; their processes are recorded in the database, so a
    restarted server still knows (and can stop) the services it started before."""

    def __init__(self, store: Store, settings: Settings):
        self.store, self.settings = store, settings

    def start(self, tenant: str, job: Job, api_key_hash: str | None) -> Service:
        from opentinker.serving.auth import hash_api_key
        from opentinker.serving.deploy import SERVICE_IMPORT, start_bento

        proxy_key = f"svc-{secrets.token_urlsafe(32)}"
        hashes = " ".join(filter(None, (api_key_hash, hash_api_key(proxy_key))))
        name, version = job.result.model_name, job.result.model_version
        service_id = f"svc-{secrets.token_hex(6)}"
        env = {key: os.environ[key] for key in ("PATH", "HOME", "LANG") if key in os.environ}
        env.update(
            OPENTINKER_DATA_DIR=str(tenants.data_dir(tenant, self.settings)),
            OPENTINKER_MLFLOW_TRACKING_URI=tenants.tracking_uri(tenant, self.settings),
            OPENTINKER_SERVE_MODEL=f"models:/{name}/{version}",
            OPENTINKER_SERVE_API_KEY_HASH=hashes,
            OPENTINKER_SERVE_RELOAD_INTERVAL_S="0",
            BENTOML_DO_NOT_TRACK="True",
            **tenant_credentials(tenant, self.settings),
        )
        log = self.settings.resolved_data_dir / "server" / "logs" / f"{service_id}.log"
        process = start_bento(f"policy {name}/{version}", SERVICE_IMPORT, env, log=log)
        row = Service(
            id=service_id,
            tenant=tenant,
            job_id=job.id,
            model_name=name,
            model_version=version,
            url=process.url,
            process=process.to_dict(),
            proxy_key=proxy_key,
        )
        with self.store.session() as session:
            session.add(row)
        return row

    def get(self, tenant: str, service_id: str) -> Service | None:
        with self.store.session() as session:
            row = session.get(Service, service_id)
            return row if row is not None and row.tenant == tenant else None

    def list(self, tenant: str) -> list[Service]:
        with self.store.session() as session:
            query = sa.select(Service).where(Service.tenant == tenant, Service.stopped_at.is_(None))
            return list(session.scalars(query.order_by(Service.created_at)))

    def stop(self, service: Service) -> None:
        ServiceProcess.from_dict(service.process).stop()
        with self.store.session() as session:
            session.get(Service, service.id).stopped_at = time.time()

    def stop_all(self) -> list[str]:
        """Stop every service still running; their ids."""
        with self.store.session() as session:
            running = list(session.scalars(sa.select(Service).where(Service.stopped_at.is_(None))))
        for service in running:
            self.stop(service)
        return [service.id for service in running]
