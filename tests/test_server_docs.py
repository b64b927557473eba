"""docs/service.md's API reference names every route of the server's OpenAPI schema (the Tinker routes are
docs/tinker_api.md's), so the reference cannot fall behind the code."""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "service.md"


def test_every_route_is_in_the_api_reference(tmp_path, monkeypatch):
    from opentinker.infra.settings import Settings
    from opentinker.server.app import create_app

    schema = create_app(Settings(data_dir=tmp_path), jobs=False).openapi()
    text = DOC.read_text()
    routes = [
        f"`{method.upper()} {path}`"
        for path, operations in schema["paths"].items()
        for method in operations
        if not path.startswith("/api/v1")
    ]
    assert len(routes) > 20
    missing = [route for route in routes if route not in text]
    assert not missing, f"docs/service.md lacks {missing}"
