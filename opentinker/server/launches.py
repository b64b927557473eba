"""What passes between the server and a job attempt: the launch (worker → server), then progress and the result
(the attempt's trusted side → server).

A worker, holding a key with the ``worker`` scope, asks for a flow run's launch before it starts anything: the server
answers only for a flow run it made for an unfinished job, so a flow run created behind its back (Prefect's API has
no tenants) starts nothing. The answer holds the resolved spec, the job's run folder and the tenant's store (for the
attempt's trusted side), the tenant's own MLflow user and S3 identity where it has them (never the operator's), the
sandbox's read-only code and environment, the tenant's limits, and a fresh token for this attempt. The token stays
with the trusted attempt process (the sandbox never holds it): with it the attempt reports progress and, once, its
typed result, which the server stores on the job — the job record's one writer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import secrets
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa

from opentinker.infra.cgroups import limits_for
from opentinker.infra.settings import Settings
from opentinker.tasks.train import run_dir

from . import mlflow_users, s3_users, tenants
from .db import Job, Store, Tenant, Upload
from .models import tenant_writer
from .schemas import JobResult, LaunchInfo, PendingWork, Progress, ProgressReport

if TYPE_CHECKING:
    from opentinker.tasks.spec import RunSpec

PASSED_SETTINGS = ("ray_address", "ray_num_cpus", "rollout_resource", "rollout_node_timeout_s")
"""Settings a job inherits from the server as they are (where its compute is); stores are the tenant's own."""


def launch(store: Store, settings: Settings, flow_run_id: str, host: str = "") -> LaunchInfo | None:
    """The launch of the job attempt behind ``flow_run_id``, with a new token; None when no unfinished job has it."""
    token = secrets.token_urlsafe(32)
    with store.session() as session:
        job = session.scalars(
            sa.select(Job).where(Job.flow_run_id == flow_run_id, Job.state.in_(("QUEUED", "RUNNING")))
        ).first()
        if job is None or job.cancel_requested:
            return None
        job.token_hash, job.launch_host = _digest(token), host
        upload = session.get(Upload, job.upload_id) if job.upload_id else None
        quotas = session.get(Tenant, job.tenant)
        tenant, job_id, spec = job.tenant, job.id, job.spec
    named = tuple(mlflow_users.job_model_names(spec)) if mlflow_users.enabled(settings) else ()
    try:
        mlflow_user = tenant_writer(tenant, settings, named)
    except mlflow_users.NameTaken as exc:  # made by another MLflow user first: the job ends here, naming it
        _fail(store, job_id, str(exc))
        return None
    s3_env = s3_users.tenant_env(tenant, settings)
    env = {
        "OPENTINKER_SANDBOX": "none",  # the job is inside the sandbox already, which allows no nested one
        "MPLCONFIGDIR": "/tmp/matplotlib",
        "HF_HUB_OFFLINE": "1",
        **s3_env,
    }
    for name in PASSED_SETTINGS:
        value = getattr(settings, name)
        if value not in ("", None):
            env[f"OPENTINKER_{name.upper()}"] = str(value)
    readonly = [str(cache) for cache in _base_models(spec, settings)]
    code = None
    if upload is not None:
        code = tenants.uploads_dir(tenant, settings) / upload.id
        if settings.ray_address:  # a Ray cluster imports the package through the job's runtime env
            modules = [str(code / name) for name in upload.packages if (code / name).is_dir()]
            env["RAY_JOB_CONFIG_JSON_ENV_VAR"] = json.dumps({"runtime_env": {"py_modules": modules}})
    return LaunchInfo(
        job_id=job_id,
        tenant=tenant,
        token=token,
        spec=spec,
        job_dir=str(run_dir(tenants.data_dir(tenant, settings), job_id)),
        tracking_uri=tenants.tracking_uri(tenant, settings),
        tracking_username=mlflow_user.username if mlflow_user else "",
        tracking_password=mlflow_user.password if mlflow_user else "",
        experiment=tenants.experiment(tenant),
        s3_env=s3_env,
        readonly=readonly,
        code=str(code) if code else None,
        env=env,
        limits=dataclasses.asdict(limits_for(quotas, settings)),
        isolated=not settings.ray_address,
    )


def pending_work(store: Store) -> PendingWork:
    """The queued and running jobs and the tenants' limits, as one value that changes whenever a worker's poll could
    find something new: a flow run made (or remade for a retry), a job started, ended or cancelled, a limit changed."""
    with store.session() as session:
        waiting = sa.and_(Job.state == "QUEUED", Job.flow_run_id.is_not(None))
        queued, newest = session.execute(sa.select(sa.func.count(), sa.func.max(Job.queued_at)).where(waiting)).one()
        running = session.scalar(sa.select(sa.func.count()).where(Job.state == "RUNNING"))
        limits = dict(session.execute(sa.select(Tenant.name, Tenant.max_running_jobs)).tuples().all())
    return PendingWork(queued=queued, running=running, newest_queued_at=newest, limits=limits)


def _fail(store: Store, job_id: str, reason: str) -> None:
    """End a job that cannot start (FAILED, ``reason``); the worker then refuses its flow run."""
    with store.session() as session:
        session.execute(
            sa.update(Job)
            .where(Job.id == job_id, Job.state.in_(("QUEUED", "RUNNING")))
            .values(state="FAILED", reason=reason[:1000], ended_at=time.time(), updated_at=time.time())
        )


def _base_models(spec: RunSpec, settings: Settings) -> list[Path]:
    """The server's converted base models, for a GRPO job that reads them (the spec's cache is the server's, filled in
    at submit): converted here on the first such job, so a sandbox only ever reads them."""
    from opentinker.agents.lm_weights import converted_checkpoint

    cache = tenants.base_model_cache(settings)
    if spec.algorithm != "grpo" or spec.engine.cache_dir != str(cache):
        return []
    converted_checkpoint(None, cache)  # the bundled SmolLM2: its tokenizer serves every base model
    return [cache]


def report_progress(store: Store, job_id: str, token: str, report: ProgressReport) -> bool:
    """Record a running attempt's progress; False when the token is not this job's current one."""
    with store.session() as session:
        job = session.get(Job, job_id)
        if job is None or not job.token_hash or not hmac.compare_digest(job.token_hash, _digest(token)):
            return False
        if job.state not in ("QUEUED", "RUNNING"):
            return True
        sps = report.metrics.get("charts/sps")
        left = max(report.total - report.step, 0)
        job.progress = Progress(
            step=report.step,
            total=report.total,
            steps_per_s=sps,
            mean_return=report.metrics.get("charts/episodic_return_mean"),
            eta_s=left / sps if sps else None,
            updated_at=datetime.now(UTC),
        )
    return True


def _digest(token: str) -> str:
    """A random 256-bit token needs no slow hash: SHA-256 of it cannot be reversed."""
    return hashlib.sha256(token.encode()).hexdigest()


def record_result(store: Store, job_id: str, token: str, result: JobResult) -> bool:
    """Store the attempt's result on its job (the sync loop marks the job SUCCEEDED once its flow run completes);
    False when the token is not this job's current one."""
    with store.session() as session:
        job = session.get(Job, job_id)
        if job is None or not job.token_hash or not hmac.compare_digest(job.token_hash, _digest(token)):
            return False
        if job.state in ("QUEUED", "RUNNING"):
            job.result = result
    return True
