"""docs/service.md's API reference names every route of the server's OpenAPI schema (the Tinker routes are
docs/tinker_api.md's), and no doc names a ``/v1/`` route the server does not have, so the reference cannot fall behind
the code in either direction."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
DOC = DOCS / "service.md"
MENTION = re.compile(r"`(GET|POST|PUT|PATCH|DELETE) (/v1/[^`\s?]*)")
"""A route as the docs write one: `POST /v1/jobs {...}`, `GET /v1/jobs/{id}/result`."""


@pytest.fixture(scope="module")
def routes(tmp_path_factory) -> set[tuple[str, str]]:
    from opentinker.infra.settings import Settings
    from opentinker.server.app import create_app

    schema = create_app(Settings(data_dir=tmp_path_factory.mktemp("data")), jobs=False).openapi()
    return {
        (method.upper(), path)
        for path, operations in schema["paths"].items()
        for method in operations
        if not path.startswith("/api/v1")
    }


def _shape(path: str) -> str:
    """The path with its parameters unnamed: `/v1/tenants/{t}` is `/v1/tenants/{name}`."""
    return re.sub(r"\{[^}]*\}", "{}", path)


def test_every_route_is_in_the_api_reference(routes):
    text = DOC.read_text()
    assert len(routes) > 20
    missing = [f"`{method} {path}`" for method, path in sorted(routes) if f"`{method} {path}`" not in text]
    assert not missing, f"docs/service.md lacks {missing}"


def test_every_route_the_docs_name_exists(routes):
    known = {(method, _shape(path)) for method, path in routes}
    mentions = [
        (doc.name, method, path)
        for doc in sorted(DOCS.glob("*.md"))
        if doc.name != "tinker_api.md"
        for method, path in MENTION.findall(doc.read_text())
    ]
    assert len(mentions) > 20
    stale = [f"{doc}: {method} {path}" for doc, method, path in mentions if (method, _shape(path)) not in known]
    assert not stale, f"routes the server does not have: {stale}"
