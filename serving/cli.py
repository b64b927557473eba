"""Serving commands: ``opentinker serve MODEL_REF`` and ``opentinker package MODEL_REF``.

Heavy imports (bentoml, mlflow) happen inside the commands so ``opentinker --help`` stays fast.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from .auth import API_KEY_ENV


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
    app.command("package")(package)


ModelRef = Annotated[
    str, typer.Argument(help="models:/NAME@champion, models:/NAME/VERSION, runs:/RUN/policy or an export directory.")
]


def serve(
    model_ref: ModelRef,
    api_key: Annotated[
        str | None,
        typer.Option(
            help=f"API key clients must send as 'Authorization: Bearer <key>' (or ${API_KEY_ENV}).", show_default=False
        ),
    ] = None,
    api_key_file: Annotated[Path | None, typer.Option(help="Read the API key from this file instead.")] = None,
    host: Annotated[
        str, typer.Option(help="Interface to bind; keep 127.0.0.1 unless a proxy with TLS fronts it.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0 picks a free one).")] = 3000,
    workers: Annotated[int, typer.Option(help="Server worker processes.")] = 1,
    reload_interval: Annotated[float, typer.Option(help="Seconds between alias checks (0 disables).")] = 10.0,
) -> None:
    """Serve a policy over HTTP with API-key auth until Ctrl+C."""
    from .auth import ApiKeyError, hash_api_key, resolve_api_key
    from .deploy import DeploymentError, start_server, stop_process_group, wait_ready

    try:
        key_hash = hash_api_key(resolve_api_key(api_key, api_key_file))
    except ApiKeyError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    from opentinker.tracking.registry import PolicyStoreError

    from .model_slot import resolve

    try:
        resolve(model_ref)
    except PolicyStoreError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    settings = {"workers": workers, "reload_interval_s": reload_interval}
    proc, url = start_server(model_ref, key_hash, host, port or None, settings)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a process manager's stop also stops the server
    try:
        wait_ready(url, proc)
        typer.secho(
            f"serving {model_ref} at {url}  (POST /act, /act_batch, /metadata, /reload; GET /readyz)", fg="green"
        )
        proc.wait()
    except DeploymentError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        pass
    finally:
        stop_process_group(proc)


def package(
    model_ref: ModelRef,
    bundle: Annotated[
        bool, typer.Option(help="Bundle the resolved version into the Bento (else serve MODEL_REF from the registry).")
    ] = True,
) -> None:
    """Build a Bento for the policy service (offline); then `bentoml containerize TAG` for Kubernetes."""
    from .package import package_policy

    result = package_policy(model_ref, bundle=bundle)
    typer.echo(f"built {result.tag} serving {result.serves} (policy version {result.policy_version})")
    typer.echo(f"bento: {result.path}")
    typer.echo(f"next: bentoml containerize {result.tag}   (see docs/serving.md)")
