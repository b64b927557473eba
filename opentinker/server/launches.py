"""What passes between the server and a job attempt: the launch (worker → server) and progress (job → server).

A worker, holding a key with the ``worker`` scope, asks for a flow run's launch before it starts anything: the server
answers only for a flow run it made for an unfinished job, so a flow run created behind its back (Prefect's API has
no tenants) starts nothing. The answer holds the sandbox's layout and environment: the tenant's directory and store,
the uploaded code, and a fresh token for this attempt, the only credential the job's code ever sees. The job reports
its progress with that token; it cannot act for its tenant or see anything of another.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from pathlib import Path

import sqlalchemy as sa

from opentinker.infra.settings import Settings

from . import tenants
from .db import Job, Store, Upload
from .models import prepare_store
from .schemas import LaunchInfo, ProgressReport

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
        tenant, job_id, spec = job.tenant, job.id, job.spec
    home = tenants.data_dir(tenant, settings)
    (home / ".prefect").mkdir(parents=True, exist_ok=True)
    prepare_store(tenant, settings)
    env = {
        "OPENTINKER_DATA_DIR": str(home),
        "OPENTINKER_MLFLOW_TRACKING_URI": tenants.tracking_uri(tenant, settings),
        "OPENTINKER_MLFLOW_EXPERIMENT": tenants.experiment(tenant),
        "OPENTINKER_SANDBOX": "none",  # the job is inside the sandbox already, which allows no nested one
        "PREFECT_HOME": str(home / ".prefect"),
        "MPLCONFIGDIR": "/tmp/matplotlib",
    }
    for name in PASSED_SETTINGS:
        value = getattr(settings, name)
        if value not in ("", None):
            env[f"OPENTINKER_{name.upper()}"] = str(value)
    readonly = [str(cache) for cache in _base_models(spec, settings)]
    if upload is not None:
        code = tenants.uploads_dir(tenant, settings) / upload.id
        readonly.append(str(code))
        env["PYTHONPATH"] = str(code)
        if settings.ray_address:  # a Ray cluster imports the package through the job's runtime env
            modules = [str(code / name) for name in upload.packages if (code / name).is_dir()]
            env["RAY_JOB_CONFIG_JSON_ENV_VAR"] = json.dumps({"runtime_env": {"py_modules": modules}})
    isolated = not (settings.ray_address or settings.mlflow_tracking_uri or settings.s3_endpoint_url)
    return LaunchInfo(
        job_id=job_id, tenant=tenant, token=token, writable=[str(home)], readonly=readonly, env=env, isolated=isolated
    )


def _base_models(spec: dict, settings: Settings) -> list[Path]:
    """The server's converted base models, for a GRPO job that reads them (the spec's cache is the server's, filled in
    at submit): converted here on the first such job, so a sandbox only ever reads them."""
    from opentinker.agents.lm_weights import converted_checkpoint

    cache = tenants.base_model_cache(settings)
    if spec["engine"]["algorithm"] != "grpo" or spec["engine"].get("cache_dir") != str(cache):
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
        job.progress = {
            "step": report.step,
            "total": report.total,
            "steps_per_s": sps,
            "mean_return": report.metrics.get("charts/episodic_return_mean"),
            "eta_s": left / sps if sps else None,
            "updated_at": time.time(),
        }
    return True


def _digest(token: str) -> str:
    """A random 256-bit token needs no slow hash: SHA-256 of it cannot be reversed."""
    return hashlib.sha256(token.encode()).hexdigest()
