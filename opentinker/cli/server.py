"""``opentinker server up|keys|tenants``: run the OpenTinker server and administer it on its own machine.

``keys`` and ``tenants`` act on the server's database directly (``server_database_url``, SQLite under the data dir by
default), so the first admin key can be made before any key exists; over HTTP an admin key does the same. Every
command takes ``--config`` (the server's settings file), and none makes a new database where there was none: a key
written into a store no server reads would be lost without a word.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Annotated

import click
import typer
from rich.table import Table

from opentinker.cli.console import cli_errors, console

app = typer.Typer(help="The OpenTinker server: training jobs from laptops, per tenant (docs/service.md).")
keys_app = typer.Typer(help="API keys: create (printed once), list, revoke.", no_args_is_help=True)
tenants_app = typer.Typer(help="Tenants and their quotas.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
app.add_typer(tenants_app, name="tenants")


Config = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="The server's TOML settings file (else OPENTINKER_CONFIG, else ./opentinker.toml; docs/deploy.md).",
    ),
]


def _settings(config: Path | None):
    """The server's settings, from ``config`` when given (it then also holds for every process this one starts)."""
    import os

    from opentinker.infra.settings import get_settings

    if config is not None:
        if not config.is_file():
            raise typer.BadParameter(f"{config}: no such file", param_hint="--config")
        os.environ["OPENTINKER_CONFIG"] = str(config.resolve())
        get_settings.cache_clear()
    return get_settings()


def _existing_database(settings) -> str | None:
    """The server's database URL, or None when it is an embedded SQLite file that does not exist yet."""
    if settings.server_database_url:
        return settings.server_database_url
    path = settings.data_dir.expanduser().resolve() / "server" / "server.db"
    return settings.server_database if path.is_file() else None


def _store(config: Path | None):
    from opentinker.server.db import Store

    settings = _settings(config)
    url = _existing_database(settings)
    if url is None:
        where = settings.data_dir.expanduser().resolve() / "server" / "server.db"
        raise typer.BadParameter(
            f"no server database at {where}: name the server's settings (--config FILE, OPENTINKER_CONFIG, or "
            "OPENTINKER_DATA_DIR / server_database_url), or start it there first (opentinker server up)",
            param_hint="--config",
        )
    return Store(url)


def _when(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@app.command()
@cli_errors
def up(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8600,
    jobs: Annotated[bool, typer.Option(help="Run training jobs (Prefect work pool and worker).")] = True,
    worker: Annotated[
        bool, typer.Option(help="Also run a worker here (--no-worker: `opentinker server worker` runs elsewhere).")
    ] = True,
    prefect_database: Annotated[
        str | None,
        typer.Option(
            click_type=click.Choice(["sqlite", "postgres"]),
            help="The embedded Prefect's database (default: the server_prefect_database setting, sqlite).",
        ),
    ] = None,
    config: Config = None,
) -> None:
    """Serve the API until interrupted; with nothing configured, on the local stack (SQLite, local Prefect)."""
    from opentinker.server.launcher import serve

    settings = _settings(config)
    if prefect_database is not None:
        settings = settings.model_copy(update={"server_prefect_database": prefect_database})

    def ready(url: str, prefect_url: str) -> None:
        console.print(f"OpenTinker server on {url}", highlight=False)
        if prefect_url:
            console.print(f"Prefect UI (jobs as flow runs, one work queue per tenant): {prefect_url}", highlight=False)
        console.print("Make a key: opentinker server keys create --tenant NAME", highlight=False)

    serve(host, port, jobs=jobs, worker=worker, on_ready=ready, settings=settings)


@app.command()
@cli_errors
def down(config: Config = None) -> None:
    """Stop the embedded Prefect server and worker a killed `server up` left running."""
    from opentinker.server.launcher import stop_services

    settings = _settings(config)
    if _existing_database(settings) is None:
        console.print(f"nothing was running: no server under {settings.data_dir.expanduser().resolve()}")
        return
    stopped = stop_services(settings)
    console.print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


@app.command()
@cli_errors
def worker(
    server: Annotated[str, typer.Option(help="The OpenTinker server's URL (launches and progress go there).")],
    key_file: Annotated[Path, typer.Option(help="File holding a key with the `worker` scope.")],
    name: Annotated[str | None, typer.Option(help="Worker name in Prefect (default: generated).")] = None,
    limit: Annotated[int | None, typer.Option(help="Most jobs this worker runs at once.")] = None,
    config: Config = None,
) -> None:
    """Run jobs of the server's work pool on this machine, each in its sandbox (PREFECT_API_URL names Prefect)."""
    from opentinker.server.worker import run_worker

    _settings(config)

    run_worker(server, key_file.read_text().strip(), name=name, limit=limit)


@keys_app.command("create")
@cli_errors
def keys_create(
    tenant: Annotated[str, typer.Option(help="Tenant the key acts for (created with default quotas if new).")],
    scope: Annotated[
        list[str] | None,
        typer.Option(help="admin, jobs, read, models, tinker, worker (repeat; default: jobs, read, models, tinker)."),
    ] = None,
    label: Annotated[str, typer.Option(help="A note shown in listings.")] = "",
    config: Config = None,
) -> None:
    """Make a key and print it, once: only its salted hash is stored."""
    from opentinker.server.keys import DEFAULT_SCOPES, KeyRing

    info, key = KeyRing(_store(config)).create(tenant, scope or DEFAULT_SCOPES, label)
    console.print(key, markup=False, highlight=False)
    console.print(
        f"key {info.id} for tenant {info.tenant}, scopes {', '.join(info.scopes)} (shown once; keep it secret)",
        style="dim",
        highlight=False,
    )


@keys_app.command("list")
@cli_errors
def keys_list(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys.")] = None, config: Config = None
) -> None:
    """Every key's id, tenant, scopes and dates (never a secret)."""
    from opentinker.server.keys import KeyRing

    table = Table("id", "tenant", "scopes", "label", "created", "revoked")
    for info in KeyRing(_store(config)).list(tenant):
        table.add_row(
            info.id, info.tenant, ",".join(info.scopes), info.label, _when(info.created_at), _when(info.revoked_at)
        )
    console.print(table)


@keys_app.command("revoke")
@cli_errors
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="The key's id (from `keys list`).")], config: Config = None
) -> None:
    """Revoke a key: every server process refuses it from its next request on."""
    from opentinker.server.keys import KeyRing

    info = KeyRing(_store(config)).revoke(key_id)
    if info is None:
        console.print(f"[bold red]error:[/] key: no key with id {key_id!r}")
        raise typer.Exit(1)
    console.print(f"revoked key {info.id} of tenant {info.tenant}", highlight=False)


@tenants_app.command("set")
@cli_errors
def tenants_set(
    tenant: Annotated[str, typer.Argument(help="Tenant name (created if new).")],
    max_running_jobs: Annotated[int | None, typer.Option(help="Jobs running at once.")] = None,
    max_queued_jobs: Annotated[int | None, typer.Option(help="Jobs waiting at once.")] = None,
    max_steps_per_job: Annotated[int | None, typer.Option(help="Largest steps of one job.")] = None,
    max_gpus: Annotated[float | None, typer.Option(help="GPUs one job may ask for.")] = None,
    job_memory_mb: Annotated[int | None, typer.Option(help="Memory of one job in MiB (a cgroup limit).")] = None,
    job_max_processes: Annotated[int | None, typer.Option(help="Processes and threads of one job at once.")] = None,
    job_cpus: Annotated[float | None, typer.Option(help="CPU cores one job may use.")] = None,
    config: Config = None,
) -> None:
    """Create a tenant or change its quotas (options left out keep their value; a job limit never set is the
    server's default: `job_memory_mb`, `job_max_processes`, `job_cpus`)."""
    from opentinker.server.tenants import set_quotas

    changes = {
        "max_running_jobs": max_running_jobs,
        "max_queued_jobs": max_queued_jobs,
        "max_steps_per_job": max_steps_per_job,
        "max_gpus": max_gpus,
        "job_memory_mb": job_memory_mb,
        "job_max_processes": job_max_processes,
        "job_cpus": job_cpus,
    }
    with _store(config).session() as session:
        row = set_quotas(session, tenant, **{k: v for k, v in changes.items() if v is not None})
        console.print(
            f"tenant {row.name}: running {row.max_running_jobs}, queued {row.max_queued_jobs}, "
            f"steps/job {row.max_steps_per_job}, GPUs/job {row.max_gpus}, {_job_limits(row)}",
            highlight=False,
        )


def _job_limits(row) -> str:
    """A tenant's per-job limits as set ('default' where the server's setting applies)."""
    memory = f"{row.job_memory_mb} MiB" if row.job_memory_mb is not None else "default"
    processes = row.job_max_processes if row.job_max_processes is not None else "default"
    cpus = f"{row.job_cpus:g}" if row.job_cpus is not None else "default"
    return f"memory/job {memory}, processes/job {processes}, CPUs/job {cpus}"


@tenants_app.command("list")
@cli_errors
def tenants_list(config: Config = None) -> None:
    """Every tenant and its quotas."""
    import sqlalchemy as sa

    from opentinker.server.db import Tenant

    table = Table("tenant", "running", "queued", "steps/job", "GPUs/job", "job limits", "created")
    with _store(config).session() as session:
        for row in session.scalars(sa.select(Tenant).order_by(Tenant.name)):
            table.add_row(
                row.name,
                *(str(v) for v in (row.max_running_jobs, row.max_queued_jobs, row.max_steps_per_job, row.max_gpus)),
                _job_limits(row),
                _when(row.created_at),
            )
    console.print(table)
