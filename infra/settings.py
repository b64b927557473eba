"""One source of truth for where OpenTinker's services live.

Every value comes from an ``OPENTINKER_*`` environment variable or an optional TOML file
(``OPENTINKER_CONFIG``, default ``./opentinker.toml``). Empty means the embedded default:
local Ray, MLflow on SQLite under ``data_dir``, Prefect's local mode, artifacts on local disk.
Pointing at a Ray cluster, an MLflow server, a Prefect server or S3 is configuration only.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OPENTINKER_", extra="forbid")

    data_dir: Path = Field(
        Path(".opentinker"), description="Local state: SQLite stores, artifacts, checkpoints, stack pids/logs."
    )
    warm_process_idle_s: float = Field(
        600.0,
        ge=0,
        description="How long the data dir's warm processes (`opentinker train`'s: Prefect, MLflow and the flows, and "
        "torch and the RL core, imported once, each later command and training child forked from them) wait for the "
        "next run before they exit; 0: none, every command and child is a fresh interpreter.",
    )
    ray_address: str = Field(
        "", description="Ray cluster address ('auto', 'ray://host:10001'); empty starts local Ray."
    )
    ray_num_cpus: int | None = Field(None, description="CPUs for a local Ray; None uses all cores.")
    rollout_resource: str = Field(
        "",
        description="Custom Ray resource a node must advertise to host rollout actors "
        "('rollout_node' on `opentinker cluster up` workers); empty places them anywhere.",
    )
    rollout_node_timeout_s: float = Field(
        300.0,
        gt=0,
        description="How long training waits, after its rollout actors "
        "lost their node, for a node that can host them before it fails.",
    )
    cluster_idle_timeout_s: float = Field(
        0.0,
        ge=0,
        description="0: `opentinker cluster up` starts fixed nodes; > 0: it starts an autoscaling cluster whose "
        "autoscaler launches rollout workers for pending actors and removes a worker idle this many seconds.",
    )
    mlflow_tracking_uri: str = Field("", description="MLflow server URL; empty uses sqlite:///<data_dir>/mlflow.db.")
    mlflow_experiment: str = Field("opentinker", description="Default MLflow experiment name.")
    mlflow_admin_username: str = Field(
        "",
        description="The OpenTinker server's admin user on an MLflow server run with its authentication app "
        "(`mlflow server --app-name basic-auth`): with it every tenant gets its own MLflow user, permitted on its "
        "own experiment and registered models only; empty: no MLflow users (one shared identity).",
    )
    mlflow_admin_password: str = Field("", description="Password of `mlflow_admin_username`.")
    mlflow_tenant_secret: str = Field(
        "",
        description="Secret the tenants' MLflow passwords are derived from (HMAC of the tenant's name); the same in "
        "every server process; empty: `mlflow_admin_password`.",
    )
    mlflow_ui_url: str = Field(
        "",
        description="The MLflow UI as tenants' browsers reach it (`opentinker dashboard`); empty: "
        "`mlflow_tracking_uri`.",
    )
    prefect_api_url: str = Field("", description="Prefect server API URL; empty uses Prefect's local (ephemeral) mode.")
    s3_endpoint_url: str = Field(
        "", description="S3 endpoint (SeaweedFS, MinIO, AWS); empty keeps artifacts on local disk."
    )
    s3_bucket: str = Field("opentinker", description="Bucket for artifacts and checkpoints.")
    s3_access_key: str = Field("", description="S3 access key id (falls back to boto3's usual chain when empty).")
    s3_secret_key: str = Field("", description="S3 secret key.")
    s3_region: str = Field("us-east-1", description="S3 region.")
    s3_prefix: str = Field(
        "",
        description="Key prefix of this process's objects in the bucket: a server job's `tenants/<t>/`, the only "
        "prefix its tenant's S3 identity reaches (the bucket is the operator's); empty: the bucket's root.",
    )
    s3_admin_access_key: str = Field(
        "",
        description="The OpenTinker server's admin identity on S3 (SeaweedFS's IAM API on its S3 port): with it every "
        "tenant gets its own S3 identity, permitted on its prefix `tenants/<t>/` only (docs/deploy.md); the server "
        "uses it to manage those identities and for nothing else.",
    )
    s3_admin_secret_key: str = Field("", description="Secret key of `s3_admin_access_key`.")
    s3_tenant_secret: str = Field(
        "",
        description="Secret the tenants' S3 key pairs are derived from (HMAC of the tenant's name); the same in every "
        "server process; empty: `s3_admin_secret_key`.",
    )
    server_url: str = Field(
        "",
        description="OpenTinker server the SDK and CLI send training jobs to (`opentinker login`, "
        "`opentinker.connect`); empty: everything runs on this machine.",
    )
    api_key: str = Field("", description="API key for `server_url` (else the one `opentinker login` stored).")
    credentials_file: Path = Field(
        Path("~/.config/opentinker/credentials.json"),
        description="Where `opentinker login` keeps the server URL and key (mode 0600).",
    )
    server_database_url: str = Field(
        "",
        description="The server's store of tenants, keys and jobs (SQLAlchemy URL, e.g. "
        "postgresql+psycopg2://...); empty: SQLite at <data_dir>/server/server.db.",
    )
    server_max_upload_mb: float = Field(64.0, gt=0, description="Largest env-code upload the server accepts.")
    server_pool_limit: int | None = Field(
        None,
        ge=1,
        description="Jobs running at once over all tenants (the cluster's capacity: the server's Prefect work "
        "pool's concurrency limit); None: one job per CPU core with the embedded stack, only the workers' own limits "
        "with a Prefect server of your own. Over it jobs wait, with their position.",
    )
    server_job_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="CPU niceness of the jobs a server's worker starts: training takes every idle cycle, while the "
        "API, Prefect and the worker, at normal priority, answer at once; 0 runs jobs at the server's priority.",
    )
    server_prefect_database: Literal["sqlite", "postgres"] = Field(
        "sqlite",
        description="Database of the Prefect server `opentinker server up` starts: 'sqlite' (a file), or 'postgres' "
        "(Debian's PostgreSQL on loopback, started and adopted with it): a burst of jobs waits far less for its flow "
        "runs. Ignored when `prefect_api_url` names a Prefect server of your own.",
    )
    tinker_base_models: list[str] = Field(
        ["smollm2"],
        description="Base models the server's Tinker API (/api/v1) trains and samples: 'smollm2' (the bundled "
        "SmolLM2-135M-Instruct), 'tiny' (the test model) or transformers checkpoint folders.",
    )
    tinker_ray_address: str = Field(
        "",
        description="The Ray cluster the Tinker engine runs on: the operator's, never handed to jobs (they run "
        "their own); empty: ray_address if set, else a local head the server starts.",
    )
    tinker_device: str = Field(
        "auto",
        description="Where the Tinker API's models run: 'auto' (CUDA when present), 'cpu', 'cuda', 'cuda:1', ...",
    )
    tinker_threads: int | None = Field(None, ge=1, description="torch threads of the Tinker worker (None: torch's).")
    tinker_cache_dir: str = Field("", description="Cache of converted base models; empty: <data_dir>/llm-cache.")
    tinker_tokenizer_id: str = Field(
        "",
        description="The tokenizer get_info names (the SDK's get_tokenizer loads it); empty: the server's own "
        "tokenizer folder, right for clients on this machine; set a hub id (HuggingFaceTB/SmolLM2-135M-Instruct) "
        "for others.",
    )
    tinker_session_timeout_s: float = Field(
        60.0,
        gt=0,
        description="A Tinker session whose heartbeats (every 10 s) stop this long is reaped, its memory freed.",
    )
    tinker_max_models_per_tenant: int = Field(
        8,
        ge=1,
        description="Training clients one tenant holds at once; over it create_model answers 429 and the SDK waits "
        "(a client that died frees its slot when its session is reaped).",
    )
    tinker_max_checkpoint_mb_per_tenant: float = Field(
        10240.0,
        gt=0,
        description="Tinker checkpoint storage of one tenant; over it saves answer 402 (the SDK raises BillingError).",
    )
    tinker_max_pending_per_tenant: int = Field(
        256,
        ge=1,
        description="Tinker requests of one tenant in flight at once; over it calls answer 429 (the SDK backs off).",
    )
    tinker_sample_batch_rows: int = Field(64, ge=1, description="Completions the Tinker worker samples in one batch.")
    tinker_poll_s: float = Field(
        25.0, gt=0, le=40, description="How long retrieve_future holds a pending request open (the SDK waits 45 s)."
    )
    sandbox: Literal["bwrap", "none"] = Field(
        "bwrap",
        description="Isolation of model-written code (PythonREPL): "
        "'bwrap' (bubblewrap namespaces, fails closed without them) or 'none' "
        "(in-process guard only; trusted local use).",
    )
    job_limits: Literal["cgroup", "none"] = Field(
        "cgroup",
        description="Limits on each job attempt's memory, processes and CPU: 'cgroup' (a kernel cgroup per attempt, "
        "v2 where the host offers it, else v1; fails closed without one) or 'none' (unbounded; trusted local use).",
    )
    job_memory_mb: int | None = Field(
        None,
        ge=4,
        description="Memory of one job attempt, all its processes together; over it the kernel OOM-kills and the job "
        "fails naming the limit. None: 60% of the machine's memory, at most 8 GiB. A tenant's quota overrides it.",
    )
    job_max_processes: int = Field(
        512,
        ge=1,
        description="Processes and threads one job attempt may have at once (a fork bomb stops there). A tenant's "
        "quota overrides it.",
    )
    job_cpus: float | None = Field(
        None,
        ge=0.01,
        description="CPU time of one job attempt in cores (a cgroup quota); None: every core, at `server_job_nice`. "
        "A tenant's quota overrides it.",
    )

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ):
        toml_file = Path(os.environ.get("OPENTINKER_CONFIG", "opentinker.toml"))
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if toml_file.exists():
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)

    @property
    def resolved_data_dir(self) -> Path:
        path = self.data_dir.expanduser().resolve()
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def tracking_uri(self) -> str:
        return self.mlflow_tracking_uri or f"sqlite:///{self.resolved_data_dir / 'mlflow.db'}"

    @property
    def server_database(self) -> str:
        return self.server_database_url or f"sqlite:///{self.resolved_data_dir / 'server' / 'server.db'}"

    @property
    def artifact_root(self) -> str:
        """Where a new MLflow experiment stores artifacts: S3 when configured, else the data dir."""
        if self.s3_endpoint_url:
            return f"s3://{self.s3_bucket}/mlflow"
        return (self.resolved_data_dir / "artifacts").as_uri()


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Built lazily on first use, never at import; ``get_settings.cache_clear()`` after changing the environment."""
    return Settings()
