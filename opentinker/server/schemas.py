"""Request and response models of the server's API, shared by the app and its client (pydantic only: importing this
module pulls in neither FastAPI nor Prefect)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from opentinker.tasks.spec import RunSpec


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    version: str
    jobs: bool = Field(description="Whether this server runs jobs (a Prefect work pool is attached).")


class Whoami(BaseModel):
    tenant: str
    key_id: str
    scopes: list[str]


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str = Field(description="The tenant the key acts for (created with default quotas if new).")
    scopes: list[str] = Field(
        default_factory=lambda: ["jobs", "read", "models", "tinker"],
        description="What the key may do: admin, jobs, read, models, tinker.",
    )
    label: str = Field("", max_length=200, description="A note for listings (who or what uses the key).")


class KeyOut(BaseModel):
    id: str = Field(description="The key's public id (the part after 'tml-', before '_').")
    tenant: str
    scopes: list[str]
    label: str
    created_at: datetime
    revoked_at: datetime | None = None


class KeyCreated(KeyOut):
    key: str = Field(description="The key itself: shown this once, stored only as a salted hash.")


class Quotas(BaseModel):
    """A tenant's limits; None means no limit (for the job_* limits: the server's default). Over a limit a submit
    answers 429 naming it; a job over a job_* limit ends FAILED naming it."""

    model_config = ConfigDict(extra="forbid")

    max_running_jobs: int | None = Field(
        2, ge=0, description="Jobs of the tenant running at once (its work queue's concurrency limit; 0 holds them)."
    )
    max_queued_jobs: int | None = Field(100, ge=0, description="Jobs waiting in the tenant's queue at once.")
    max_steps_per_job: int | None = Field(10_000_000, ge=1, description="Largest `steps` of one job.")
    max_gpus: float | None = Field(1.0, ge=0, description="GPUs one job may ask for (learner plus rollout actors).")
    job_memory_mb: int | None = Field(
        None,
        ge=4,
        description="Memory of one job attempt in MiB (a cgroup limit; over it the job fails naming the limit); "
        "None: the server's `job_memory_mb`.",
    )
    job_max_processes: int | None = Field(
        None,
        ge=1,
        description="Processes and threads one job attempt may have at once; None: the server's `job_max_processes`.",
    )
    job_cpus: float | None = Field(
        None, ge=0.01, description="CPU cores one job attempt may use (a cgroup quota); None: the server's `job_cpus`."
    )


class TenantOut(Quotas):
    name: str
    created_at: datetime


class QuotasUpdate(BaseModel):
    """Fields to change; a field sent as null removes that limit (a job_* limit: back to the server's default), a
    field left out keeps its value."""

    model_config = ConfigDict(extra="forbid")

    max_running_jobs: int | None = Field(None, ge=0)
    max_queued_jobs: int | None = Field(None, ge=0)
    max_steps_per_job: int | None = Field(None, ge=1)
    max_gpus: float | None = Field(None, ge=0)
    job_memory_mb: int | None = Field(None, ge=4)
    job_max_processes: int | None = Field(None, ge=1)
    job_cpus: float | None = Field(None, ge=0.01)


class ErrorBody(BaseModel):
    detail: Any = Field(description="One line naming the field or the limit, and what was expected.")


JobState = Literal["QUEUED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"]
FINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")


class JobSubmit(BaseModel):
    """A training job: the run spec in the form a config file writes it, plus how to queue it."""

    model_config = ConfigDict(extra="forbid")

    spec: dict[str, Any] = Field(
        description="RunSpec fields as a config file writes them: env_id, algorithm, steps, seed, the "
        "algorithm's table ([ppo], [dqn]), ... (docs/pipeline.md). run_name, experiment and resume are the server's."
    )
    priority: int = Field(0, ge=0, le=10, description="Higher runs sooner among the tenant's queued jobs (0-10).")
    idempotency_key: str | None = Field(
        None, min_length=1, max_length=200, description="The same key again returns the job it made, not a new one."
    )
    upload_id: str | None = Field(None, description="Env code uploaded with POST /v1/uploads (for module:Class ids).")


class QueueInfo(BaseModel):
    position: int = Field(description="1 = next of the tenant's queued jobs to start.")
    queued: int = Field(description="The tenant's jobs waiting now.")
    waiting_for: str = Field(description="What the job waits for: a running slot of the tenant, a worker, capacity.")


class Progress(BaseModel):
    """A running job's progress: the attempt's last report, as the job record stores it (the phase is the job's)."""

    phase: str = Field("starting", description="starting, running, training, retrying, cancelling.")
    step: int = 0
    total: int = 0
    steps_per_s: float | None = None
    mean_return: float | None = None
    eta_s: float | None = None
    updated_at: datetime | None = None


class JobOut(BaseModel):
    id: str
    state: JobState
    env_id: str
    algorithm: str
    steps: int
    priority: int
    attempts: int
    model_name: str
    created_at: datetime
    started_at: datetime | None = None
    ended_at: datetime | None = None
    reason: str = Field("", description="Why it failed or was cancelled, or what happened to it last.")
    queue: QueueInfo | None = None
    progress: Progress | None = None
    flow_run_id: str | None = None
    flow_run_url: str | None = None


class KindResult(BaseModel):
    """A multi-agent group's agent kind: its registered model and evaluation."""

    model_config = ConfigDict(extra="forbid")

    model_name: str
    model_version: str
    eval_mean: float
    eval_std: float


class JobResult(BaseModel):
    """What a finished job produced: reported by its last attempt's trusted side, stored on the job by the server."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["policy", "grpo", "group"] = "policy"
    run_id: str = Field(max_length=64)
    experiment_id: str = Field(max_length=64)
    model_name: str = Field(max_length=300)
    model_version: str = Field("", max_length=32, description="The registered version (a group: one per kind).")
    aliases: list[str] = Field(max_length=8)
    decision: str = Field(max_length=1000)
    eval_mean: float | None = Field(None, description="A policy's mean evaluation return (not GRPO).")
    eval_std: float | None = None
    eval_action: Literal["greedy", "sampled"] | None = Field(
        None, description="A policy's served action, which the gate judged (eval_mean): greedy or sampled actions."
    )
    heldout_success: float | None = Field(None, description="GRPO: the adapter's held-out success rate.")
    global_step: int | None = Field(None, description="Env steps reached; GRPO: optimiser updates.")
    kinds: dict[str, KindResult] = Field(default_factory=dict, max_length=64, description="A group: per agent kind.")


class LogLine(BaseModel):
    timestamp: datetime
    level: int
    name: str
    message: str


class UploadOut(BaseModel):
    id: str
    filename: str
    size: int
    sha256: str
    packages: list[str] = Field(description="Top-level packages (and modules) the archive holds.")
    created_at: datetime


class LaunchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    flow_run_id: str
    host: str = Field("", description="The worker's host name (the server watches the processes of its own host).")


class PendingWork(BaseModel):
    """The jobs a worker's next Prefect poll could take or make room for: polling Prefect writes to its database
    (each poll marks the pool's queues and deployments polled), so a worker polls it only when this changes."""

    queued: int = Field(description="Jobs waiting in Prefect (queued, their flow run made).")
    running: int = Field(description="Jobs running: one ending frees a slot for a queued one.")
    newest_queued_at: float | None = Field(description="When the newest of the queued jobs was queued (Unix s).")
    limits: dict[str, int | None] = Field(description="Each tenant's running-jobs limit: one raised lets more start.")


class LaunchInfo(BaseModel):
    """What a worker needs to run one attempt of a job: the spec, where its files go, its sandbox and limits."""

    job_id: str
    tenant: str
    token: str = Field(
        description="The attempt's own credential (progress, result); never the tenant's key, and "
        "held by the trusted attempt process only, never by the sandbox."
    )
    spec: RunSpec = Field(description="The job's resolved run spec, as the job record holds it.")
    job_dir: str = Field(description="The job's run folder (checkpoints, export): written by trusted code only.")
    tracking_uri: str = Field(description="The tenant's MLflow store, written by the attempt's trusted side.")
    tracking_username: str = Field("", description="The tenant's own MLflow user (an MLflow server with users).")
    tracking_password: str = Field("", description="Its password: the attempt's trusted side writes as the tenant.")
    experiment: str
    s3_env: dict[str, str] = Field(
        default_factory=dict,
        description="The tenant's own S3 identity (OPENTINKER_S3_* variables: endpoint, bucket, its key pair), for the "
        "attempt's trusted side; the sandbox's environment holds the same. Never the operator's.",
    )
    readonly: list[str] = Field(description="Bound read-only into the sandbox at the same path: base models.")
    code: str | None = Field(None, description="The tenant's uploaded code: bound read-only at /code, on PYTHONPATH.")
    env: dict[str, str] = Field(description="The sandboxed child's environment (nothing of the server's).")
    limits: dict[str, float | None] = Field(description="The attempt's cgroup limits (infra.cgroups.JobLimits).")
    isolated: bool = Field(
        description="No network in the sandbox (the embedded stack); False: the host's network, for a configured "
        "Ray cluster."
    )
    server_url: str = Field("", description="Set by the worker: where the attempt reports.")


class Dashboard(BaseModel):
    """The tenant's MLflow UI and its own MLflow user (basic auth) to open it with."""

    url: str = Field(description="The MLflow UI.")
    experiment: str = Field(description="The tenant's experiment (every job's run is in it).")
    experiment_id: str
    experiment_url: str = Field(description="The experiment's page: runs, learning curves, artifacts.")
    models_url: str = Field(description="Registered models (the tenant's only).")
    username: str = Field(description="The tenant's MLflow user.")
    password: str = Field(description="Its password (derived by the server; the same on every call).")


class ProgressReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0)
    total: int = Field(ge=0)
    metrics: dict[str, float] = Field(default_factory=dict)
