"""PostgreSQL on loopback as MLflow's (or the embedded Prefect's) backend store: Debian's server binaries, our own
data dir, our own port.

PostgreSQL refuses to run as root; when we are root the server runs as the ``postgres`` system user
(``setpriv`` execs in place, so the recorded pid is the postmaster itself) and, if that user cannot reach
the requested directory (e.g. a 0700 pytest temp dir), the cluster lives in ``/tmp/opentinker-pg-<hash>``.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import pwd
import secrets
import shutil
import subprocess
from pathlib import Path

from opentinker.infra.files import atomic_write
from opentinker.infra.processes import ServiceError, ServiceProcess, free_ports, start

DATABASE = "mlflow"
USER = "opentinker"
INSTALL_HINT = "install Debian's `postgresql` package (`apt-get install -y postgresql`) or put initdb/postgres on PATH"


class PostgresUnavailable(ServiceError):
    """The PostgreSQL server binaries are not installed."""


def find_bindir() -> Path | None:
    """Directory holding ``initdb``, ``postgres`` and ``pg_ctl`` (PATH first, then /usr/lib/postgresql/*/bin)."""
    candidates = []
    if shutil.which("initdb"):
        candidates.append(Path(shutil.which("initdb")).resolve().parent)
    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    for bindir in candidates:
        if all((bindir / tool).exists() for tool in ("initdb", "postgres", "pg_ctl")):
            return bindir
    return None


def _run_as() -> list[str]:
    """Command prefix that drops root to the ``postgres`` user (empty when we are not root)."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam("postgres")
    except KeyError as exc:
        raise ServiceError(
            "running as root and there is no `postgres` user for the server to run as; "
            f"{INSTALL_HINT}, or run as a normal user"
        ) from exc
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--"]


def cluster_dir(directory: Path) -> Path:
    """Where the database files go: ``directory/pgdata`` unless a root-started server could not reach it."""
    if os.geteuid() != 0:
        return directory / "pgdata"
    probe = subprocess.run([*_run_as(), "test", "-x", str(directory)], check=False)
    if probe.returncode == 0:
        return directory / "pgdata"
    return Path("/tmp") / f"opentinker-pg-{hashlib.sha1(str(directory).encode()).hexdigest()[:12]}"


def _chown_to_server_user(path: Path) -> None:
    if os.geteuid() == 0:
        entry = pwd.getpwnam("postgres")
        os.chown(path, entry.pw_uid, entry.pw_gid)


def _password(directory: Path) -> str:
    path = directory / "credentials.json"
    if path.exists():
        return json.loads(path.read_text())["password"]
    password = secrets.token_hex(16)
    atomic_write(path, json.dumps({"user": USER, "password": password}), mode=0o600)
    return password


def _initdb(bindir: Path, pgdata: Path, password: str, log: Path) -> None:
    pgdata.mkdir(parents=True, exist_ok=True)
    os.chmod(pgdata, 0o700)
    _chown_to_server_user(pgdata)
    pwfile = pgdata.parent / f".pw-{secrets.token_hex(4)}"
    pwfile.write_text(password + "\n")
    os.chmod(pwfile, 0o600)
    _chown_to_server_user(pwfile)
    try:
        with open(log, "ab") as out:
            done = subprocess.run(
                [
                    *_run_as(),
                    str(bindir / "initdb"),
                    "-D",
                    str(pgdata),
                    "-U",
                    USER,
                    f"--pwfile={pwfile}",
                    "--auth=scram-sha-256",
                    "--encoding=UTF8",
                    "--no-instructions",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                check=False,
                timeout=300,
            )
    finally:
        pwfile.unlink(missing_ok=True)
    if done.returncode != 0:
        raise ServiceError(f"initdb failed for {pgdata}; see {log}")


def start_postgres(directory: Path, log: Path, timeout: float = 180.0) -> tuple[ServiceProcess, str]:
    """Start (initialising on first use) a PostgreSQL server on a free loopback port with database ``mlflow``.

    Returns the service and its SQLAlchemy URI ``postgresql+psycopg2://opentinker:…@127.0.0.1:PORT/mlflow``
    (the explicit driver matters: SQLAlchemy would otherwise look for psycopg 3, which is not installed).
    """
    bindir = find_bindir()
    if bindir is None:
        raise PostgresUnavailable(f"PostgreSQL server binaries (initdb, postgres, pg_ctl) not found: {INSTALL_HINT}.")
    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    password = _password(directory)
    pgdata = cluster_dir(directory)
    if not (pgdata / "PG_VERSION").exists():
        _initdb(bindir, pgdata, password, log)
    (port,) = free_ports(1)
    cmd = [
        *_run_as(),
        str(bindir / "postgres"),
        "-D",
        str(pgdata),
        "-p",
        str(port),
        "-c",
        "listen_addresses=127.0.0.1",
        "-c",
        "unix_socket_directories=",
        "-c",
        "max_connections=200",
        "-c",
        "fsync=on",
    ]
    service = start(
        "postgres",
        cmd,
        log,
        ready=lambda: _can_connect(f"postgresql://{USER}:{password}@127.0.0.1:{port}/postgres"),
        what=f"a connection on port {port}",
        timeout=timeout,
        url=f"postgresql://{USER}@127.0.0.1:{port}/{DATABASE}",
        ports={"tcp": port},
        stop_command=[*_run_as(), str(bindir / "pg_ctl"), "stop", "-D", str(pgdata), "-m", "fast", "-w"],
    )
    try:
        return service, database_url(directory, service, DATABASE)
    except BaseException:
        service.stop()
        raise


def database_url(directory: Path, service: ServiceProcess, database: str, driver: str = "psycopg2") -> str:
    """SQLAlchemy URL of ``database`` (created if missing) on the server ``start_postgres(directory, ...)`` runs
    (or ran: an adopted one); ``driver`` psycopg2, or asyncpg for async clients such as Prefect's server."""
    password = _password(directory.resolve())
    base = f"{USER}:{password}@127.0.0.1:{service.ports['tcp']}"
    _ensure_database(f"postgresql://{base}/postgres", database)
    return f"postgresql+{driver}://{base}/{database}"


def _can_connect(uri: str) -> bool:
    import psycopg2

    try:
        psycopg2.connect(uri, connect_timeout=3).close()
        return True
    except psycopg2.OperationalError:
        return False


def _ensure_database(admin_uri: str, name: str) -> None:
    import psycopg2

    connection = psycopg2.connect(admin_uri, connect_timeout=10)
    connection.autocommit = True
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
            if cursor.fetchone() is None:
                cursor.execute(f'CREATE DATABASE "{name}"')
    finally:
        connection.close()
