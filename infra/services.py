"""How each local service is started and known to be ready: SeaweedFS S3, MLflow server, Prefect server.

Each ``start_*`` picks its own free loopback ports, starts one real process (group) and returns only once
the service answers; on failure it stops what it started and raises ``ServiceError`` with the log tail.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

from opentinker.infra.files import atomic_write
from opentinker.infra.processes import ServiceError, ServiceProcess, free_ports, start, start_http, venv_bin
from opentinker.infra.settings import Settings

DEFAULT_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class S3Endpoint:
    """Where an S3 server lives and how to talk to it."""

    endpoint_url: str
    access_key: str
    secret_key: str
    bucket: str
    region: str = "us-east-1"

    def settings(self) -> Settings:
        return Settings(
            s3_endpoint_url=self.endpoint_url,
            s3_access_key=self.access_key,
            s3_secret_key=self.secret_key,
            s3_bucket=self.bucket,
            s3_region=self.region,
        )

    def client_env(self) -> dict[str, str]:
        """Variables that make boto3 and MLflow's S3 artifact store use this endpoint."""
        return {
            "MLFLOW_S3_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def public_dict(self) -> dict:
        """Everything but the secret key (for state files that need not hold it)."""
        return {key: value for key, value in asdict(self).items() if key != "secret_key"}


def s3_credentials(directory: Path) -> tuple[str, str]:
    """The stack's S3 key pair, generated once and kept in ``directory`` so restarts keep the same identity."""
    path = directory / "credentials.json"
    if path.exists():
        data = json.loads(path.read_text())
        return data["access_key"], data["secret_key"]
    access, secret = "opentinker", secrets.token_hex(20)
    atomic_write(path, json.dumps({"access_key": access, "secret_key": secret}), mode=0o600)
    return access, secret


def start_s3(
    directory: Path, log: Path, bucket: str, region: str = "us-east-1", timeout: float = DEFAULT_TIMEOUT_S
) -> tuple[ServiceProcess, S3Endpoint]:
    """SeaweedFS (master + volume + filer + S3 gateway) with one identity; ready once a probe object round-trips.

    That identity is an admin: through SeaweedFS's IAM API on the S3 port (its writes enabled here, admins only) it
    can make further identities, as the server does for its tenants (``opentinker.server.s3_users``)."""
    access, secret = s3_credentials(directory)
    data_dir = directory / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    identities = {
        "identities": [
            {
                "name": "opentinker",
                "credentials": [{"accessKey": access, "secretKey": secret}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    config = directory / "s3.json"
    atomic_write(config, json.dumps(identities), mode=0o600)
    names = ["master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc"]
    ports = dict(zip(names, free_ports(len(names))))
    cmd = [
        venv_bin("weed"),
        "server",
        f"-dir={data_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={ports['master']}",
        f"-master.port.grpc={ports['master_grpc']}",
        f"-volume.port={ports['volume']}",
        f"-volume.port.grpc={ports['volume_grpc']}",
        f"-filer.port={ports['filer']}",
        f"-filer.port.grpc={ports['filer_grpc']}",
        "-s3",
        f"-s3.port={ports['s3']}",
        f"-s3.port.grpc={ports['s3_grpc']}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.config={config}",
        "-s3.iam.readOnly=false",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=256",
        "-volume.max=64",
    ]
    endpoint = S3Endpoint(f"http://127.0.0.1:{ports['s3']}", access, secret, bucket, region)
    # weed treats AWS_* variables in its environment as an extra identity that overrides -s3.config: drop them.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    service = start(
        "s3",
        cmd,
        log,
        ready=lambda: _s3_round_trip(endpoint),
        what="an S3 put/get round-trip",
        timeout=timeout,
        url=endpoint.endpoint_url,
        ports=ports,
        env=env,
        cwd=directory,
        stop_timeout=10.0,  # weed lingers ~25 s after SIGTERM; its stores are crash-safe
    )
    return service, endpoint


def _s3_round_trip(endpoint: S3Endpoint) -> bool:
    """Bucket exists and a small object can be written and read back (volumes allocated, filer up)."""
    from opentinker.infra.s3 import ensure_bucket, s3_client

    settings = endpoint.settings()
    try:
        client = s3_client(settings)
        ensure_bucket(endpoint.bucket, settings=settings, client=client)
        client.put_object(Bucket=endpoint.bucket, Key=".opentinker-ready", Body=b"ok")
        return client.get_object(Bucket=endpoint.bucket, Key=".opentinker-ready")["Body"].read() == b"ok"
    except Exception:  # anything before the gateway is fully up means "not yet"
        return False


@dataclass(frozen=True)
class MlflowAuth:
    """MLflow's authentication app for ``start_mlflow``: the admin it creates on first start, where it keeps its
    users and permissions (default: SQLite beside the server's store)."""

    admin_username: str
    admin_password: str
    database_uri: str = ""


def _mlflow_auth_env(directory: Path, auth: MlflowAuth) -> dict[str, str]:
    """The auth app's config file (no permission unless granted: ``default_permission = NO_PERMISSIONS``; MLflow's
    own default, READ, would show every user every experiment) and the static secret its CSRF protection needs."""
    database = auth.database_uri or f"sqlite:///{directory / 'basic_auth.db'}"
    config = directory / "basic_auth.ini"
    atomic_write(
        config,
        "[mlflow]\ndefault_permission = NO_PERMISSIONS\n"
        f"database_uri = {database}\nadmin_username = {auth.admin_username}\n"
        f"admin_password = {auth.admin_password}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        # a checked password is remembered 60 s: without it every request pays a PBKDF2 hash (~0.1-1 s on a busy
        # core), and logging a model reads each metric's history in one request per metric
        "auth_cache_ttl_seconds = 60\n",
        mode=0o600,
    )
    secret_file = directory / "flask_secret"
    if not secret_file.exists():
        atomic_write(secret_file, secrets.token_hex(32), mode=0o600)
    return {"MLFLOW_AUTH_CONFIG_PATH": str(config), "MLFLOW_FLASK_SERVER_SECRET_KEY": secret_file.read_text()}


def start_mlflow(
    directory: Path,
    log: Path,
    s3: S3Endpoint | None,
    backend_store_uri: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    auth: MlflowAuth | None = None,
) -> ServiceProcess:
    """MLflow tracking server, one worker, no job runner; artifacts proxied to ``s3`` (or kept under ``directory``).
    With ``auth``: MLflow's authentication app (``--app-name basic-auth``), every request needing a user."""
    directory.mkdir(parents=True, exist_ok=True)
    (port,) = free_ports(1)
    backend = backend_store_uri or f"sqlite:///{directory / 'mlflow.db'}"
    destination = f"s3://{s3.bucket}/mlflow" if s3 else str(directory / "artifacts")
    cmd = [
        venv_bin("mlflow"),
        "server",
        "--backend-store-uri",
        backend,
        "--artifacts-destination",
        destination,
        "--serve-artifacts",
        "--workers",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(s3.client_env() if s3 else {})}
    if auth is not None:
        cmd += ["--app-name", "basic-auth"]
        env.update(_mlflow_auth_env(directory, auth))
    return start_http("mlflow", cmd, log, port=port, health="/health", timeout=timeout, env=env, cwd=directory)


def start_prefect(
    directory: Path,
    log: Path,
    ui: bool = True,
    timeout: float = DEFAULT_TIMEOUT_S,
    settings: dict[str, str] | None = None,
) -> ServiceProcess:
    """Prefect server (API, UI, scheduler and other services) with its own PREFECT_HOME and SQLite database.

    The caller's ``PREFECT_*`` variables are dropped (they describe a client, not this server); the UI is told
    this server's API URL, else it calls Prefect's default ``127.0.0.1:4200`` and shows "Can't connect".
    ``settings``: more ``PREFECT_*`` variables for the server.
    """
    directory.mkdir(parents=True, exist_ok=True)
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(directory),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_UI_ENABLED="true" if ui else "false",
        PREFECT_API_URL=f"{url}/api",
        PREFECT_UI_API_URL=f"{url}/api",
        PREFECT_UI_URL=url,
    )
    env.update(settings or {})
    cmd = [
        venv_bin("prefect"),
        "server",
        "start",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--ui" if ui else "--no-ui",
        "--analytics-off",
        "--no-prompt",
    ]
    return start_http("prefect", cmd, log, port=port, health="/api/health", timeout=timeout, env=env, cwd=directory)


__all__ = ["DEFAULT_TIMEOUT_S", "MlflowAuth", "S3Endpoint", "ServiceError", "start_mlflow", "start_prefect", "start_s3"]
