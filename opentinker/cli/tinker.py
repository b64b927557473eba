"""``opentinker tinker register|usage``: OpenTinker's own calls next to the Tinker API (docs/tinker_api.md).

They talk to the server over HTTP like the ``tinker`` SDK does, and find it the same way: ``--url``/``--key``, else
``TINKER_BASE_URL``/``TINKER_API_KEY`` (what a Tinker user already has set), else ``opentinker login``'s settings.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any

import typer

from opentinker.cli.console import console

app = typer.Typer(help="The Tinker API's extras: register a sampler checkpoint as a model, see your usage.")

Url = Annotated[str | None, typer.Option(help="The server (default: $TINKER_BASE_URL, then settings.server_url).")]
Key = Annotated[str | None, typer.Option(help="A tml- key (default: $TINKER_API_KEY, then settings.api_key).")]


def _call(method: str, path: str, url: str | None, key: str | None, body: dict | None = None) -> Any:
    import httpx

    from opentinker.infra.settings import get_settings

    settings = get_settings()
    url = url or os.environ.get("TINKER_BASE_URL") or settings.server_url
    key = key or os.environ.get("TINKER_API_KEY") or settings.api_key
    if not url or not key:
        console.print("[bold red]error:[/] no server: pass --url and --key, or set TINKER_BASE_URL and TINKER_API_KEY")
        raise typer.Exit(1)
    response = httpx.request(method, f"{url.rstrip('/')}{path}", json=body, headers={"X-API-Key": key}, timeout=300)
    if response.status_code >= 400:
        detail = response.json().get("detail", response.text) if response.content else response.reason_phrase
        console.print(f"[bold red]error:[/] {response.status_code}: {detail}")
        raise typer.Exit(1)
    return response.json()


@app.command()
def register(
    path: Annotated[str, typer.Argument(help="tinker://<model_id>/sampler_weights/<name>")],
    name: Annotated[str, typer.Option(help="Registered as <tenant>.<name>.")],
    alias: Annotated[str | None, typer.Option(help="Point this alias at the new version (e.g. champion).")] = None,
    url: Url = None,
    key: Key = None,
) -> None:
    """A sampler checkpoint as a new version of your registered model, servable with
    ``opentinker agent serve --llm models:/<tenant>.<name>@<alias>``."""
    body = {"path": path, "model_name": name, "alias": alias}
    result = _call("POST", "/api/v1/register_checkpoint", url, key, body)
    target = f"models:/{result['model_name']}@{alias}" if alias else result["model_uri"]
    console.print(f"registered {path} as {result['model_uri']}; serve it: opentinker agent serve --llm {target}")


@app.command()
def usage(url: Url = None, key: Key = None) -> None:
    """Your live Tinker sessions, training clients, samplers, requests in flight and checkpoint storage."""
    console.print_json(json.dumps(_call("GET", "/api/v1/usage", url, key)))
