"""``opentinker serve MODEL_REF`` and ``opentinker package MODEL_REF``: a policy service, live or as a Bento."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from opentinker.cli.console import cli_errors, console
from opentinker.serving.auth import API_KEY_ENV

app = typer.Typer()

ModelRefArg = Annotated[
    str, typer.Argument(help="models:/NAME@champion, models:/NAME/VERSION, runs:/RUN/policy or an export directory.")
]
ApiKey = Annotated[
    str | None,
    typer.Option(
        help=f"API key clients must send as 'Authorization: Bearer <key>' (or ${API_KEY_ENV}).", show_default=False
    ),
]
ApiKeyFile = Annotated[Path | None, typer.Option(help="Read the API key from this file instead.")]
Host = Annotated[str, typer.Option(help="Interface to bind; keep 127.0.0.1 unless a proxy with TLS fronts it.")]


@app.command()
@cli_errors
def serve(
    model_ref: ModelRefArg,
    api_key: ApiKey = None,
    api_key_file: ApiKeyFile = None,
    host: Host = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0 picks a free one).")] = 3000,
    workers: Annotated[int, typer.Option(help="Server worker processes.")] = 1,
    reload_interval: Annotated[float, typer.Option(help="Seconds between alias checks (0 disables).")] = 10.0,
) -> None:
    """Serve a policy over HTTP with API-key auth until Ctrl+C."""
    from opentinker.serving.foreground import serve_policy_until_stopped

    def ready(url: str) -> None:
        console.print(
            f"[green]serving {model_ref} at {url}  (POST /act, /act_batch, /metadata, /reload; GET /readyz)[/]",
            highlight=False,
        )

    settings = {"workers": workers, "reload_interval_s": reload_interval}
    serve_policy_until_stopped(model_ref, api_key, api_key_file, host, port or None, settings, ready)


@app.command()
@cli_errors
def package(
    model_ref: ModelRefArg,
    bundle: Annotated[
        bool, typer.Option(help="Bundle the resolved version into the Bento (else serve MODEL_REF from the registry).")
    ] = True,
) -> None:
    """Build a Bento for the policy service (offline); then `bentoml containerize TAG` for Kubernetes."""
    from opentinker.serving.package import package_policy

    result = package_policy(model_ref, bundle=bundle)
    console.print(f"built {result.tag} serving {result.serves} (policy version {result.policy_version})")
    console.print(f"bento: {result.path}")
    console.print(f"next: bentoml containerize {result.tag}   (see docs/serving.md)")
