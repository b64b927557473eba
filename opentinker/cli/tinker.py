"""``opentinker tinker register|usage|pull-tokenizer``: OpenTinker's own calls next to the Tinker API
(docs/tinker_api.md).

They talk to the server over HTTP like the ``tinker`` SDK does, and find it the same way: ``--url``/``--key``, else
``TINKER_BASE_URL``/``TINKER_API_KEY`` (what a Tinker user already has set), else ``opentinker login``'s settings.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer

from opentinker.cli.console import console

app = typer.Typer(
    help="The Tinker API's extras: register a sampler checkpoint as a model, see your usage, fetch a tokenizer."
)

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


_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_REVISION = re.compile(r"^[0-9a-f]{40}$")


def hub_cache() -> Path:
    """Where ``huggingface_hub`` looks for models, read from the environment as it does (``HF_HUB_CACHE``, else
    ``HF_HOME``/hub, else ``XDG_CACHE_HOME``/huggingface/hub, else ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return cache / "huggingface" / "hub"


def install_tokenizer(model: str, revision: str, files: dict[str, bytes], cache: Path) -> Path:
    """Put a tokenizer's files where ``AutoTokenizer.from_pretrained(model)`` finds them with no hub
    (``models--<org>--<name>/snapshots/<revision>/`` and ``refs/main``); the snapshot folder."""
    if not _REVISION.match(revision):
        raise ValueError(f"revision: expected 40 hex digits, got {revision!r}")
    bad = [name for name in files if not _FILE_NAME.match(name)]
    if bad or not files:
        raise ValueError(f"files: expected plain file names, got {bad or 'none'}")
    repo = cache / ("models--" + model.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    staging = repo / "snapshots" / f".{revision}.{uuid.uuid4().hex}.tmp"
    staging.mkdir(parents=True)
    try:
        for name, data in files.items():
            (staging / name).write_bytes(data)
        if snapshot.exists():
            shutil.rmtree(snapshot)
        staging.rename(snapshot)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    (repo / "refs").mkdir(exist_ok=True)
    ref = repo / "refs" / f".main.{uuid.uuid4().hex}.tmp"
    ref.write_text(revision)
    ref.replace(repo / "refs" / "main")
    return snapshot


@app.command("pull-tokenizer")
def pull_tokenizer(
    model: Annotated[str, typer.Argument(help="A base model the server serves, as your code names it.")],
    cache_dir: Annotated[
        Path | None, typer.Option(help="The Hugging Face hub cache (default: $HF_HUB_CACHE, else $HF_HOME/hub, ...).")
    ] = None,
    url: Url = None,
    key: Key = None,
) -> None:
    """The server's tokenizer for MODEL into the Hugging Face cache, under the name MODEL: then
    ``AutoTokenizer.from_pretrained(MODEL)``, the SDK's ``get_tokenizer()`` and the cookbook's find it with
    ``HF_HUB_OFFLINE=1`` (no hub, no network)."""
    found = _call("GET", f"/api/v1/tokenizers/{model}", url, key)
    files = {name: base64.b64decode(data) for name, data in found["files"].items()}
    try:
        snapshot = install_tokenizer(model, found["revision"], files, cache_dir or hub_cache())
    except ValueError as error:
        console.print(f"[bold red]error:[/] the server's answer: {error}")
        raise typer.Exit(1) from None
    console.print(f"{model} ({found['model_name']}) tokenizer, revision {found['revision'][:12]}: {snapshot}")
