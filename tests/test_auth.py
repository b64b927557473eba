"""API-key hashing, key resolution and the ASGI middlewares (in-process ASGI; served HTTP is in test_serving)."""

from __future__ import annotations

import os
import stat

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from opentinker.serving import auth
from opentinker.serving.auth import ApiKeyError, ApiKeyMiddleware, hash_api_key, verify_api_key
from opentinker.serving.middleware import BodyLimitMiddleware, ResponseHeaderMiddleware

KEY = "correct-horse-battery"


@pytest.fixture(scope="module")
def key_hash() -> str:
    return hash_api_key(KEY)


def test_hash_verifies_only_the_right_key_and_hides_it(key_hash):
    assert verify_api_key(KEY, key_hash)
    assert not verify_api_key(KEY + "x", key_hash)
    assert not verify_api_key("", key_hash)
    assert KEY not in key_hash
    assert hash_api_key(KEY) != key_hash, "a fresh salt per hash"


@pytest.mark.parametrize("bad", ["", "short", "has space inside", " padded-key "])
def test_bad_keys_are_rejected_without_echoing_them(bad):
    with pytest.raises(ApiKeyError, match="api_key") as info:
        hash_api_key(bad)
    if bad.strip():
        assert bad.strip() not in str(info.value)


@pytest.mark.parametrize("bad_hash", ["", "sha256$abc", "scrypt$x$8$1$00$00", "scrypt$16384$8$1$zz$00"])
def test_malformed_hash_is_an_error(bad_hash):
    with pytest.raises(ApiKeyError, match="scrypt"):
        verify_api_key(KEY, bad_hash)


def test_resolve_api_key_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv(auth.API_KEY_ENV, "from-the-env")
    key_file = tmp_path / "key"
    key_file.write_text("from-the-file\n")
    assert auth.resolve_api_key("from-the-flag") == "from-the-flag"
    assert auth.resolve_api_key(api_key_file=key_file) == "from-the-file"
    assert auth.resolve_api_key() == "from-the-env"
    with pytest.raises(ApiKeyError, match="not both"):
        auth.resolve_api_key("a-flag-key", key_file)
    with pytest.raises(ApiKeyError, match="no such file"):
        auth.resolve_api_key(api_key_file=tmp_path / "missing")
    monkeypatch.delenv(auth.API_KEY_ENV)
    with pytest.raises(ApiKeyError, match="required"):
        auth.resolve_api_key()


def test_hash_file_is_private_and_read_back_by_the_server_side(tmp_path, monkeypatch, key_hash):
    path = auth.write_key_hash_file(key_hash, tmp_path / "sub" / "key.hash")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert KEY not in path.read_text()
    monkeypatch.delenv(auth.HASH_ENV, raising=False)
    monkeypatch.setenv(auth.HASH_FILE_ENV, str(path))
    assert auth.key_hash_from_env() == key_hash
    monkeypatch.setenv(auth.HASH_ENV, "not-a-hash")
    with pytest.raises(ApiKeyError):
        auth.key_hash_from_env()


async def _echo(request: Request):
    body = await request.body()
    return JSONResponse({"path": request.url.path, "body_len": len(body)})


def _client(key_hash: str, max_bytes: int = 64) -> TestClient:
    app = Starlette(routes=[Route("/act", _echo, methods=["POST"]), Route("/healthz", _echo)])
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_bytes)
    app.add_middleware(ApiKeyMiddleware, key_hash=key_hash)
    app.add_middleware(ResponseHeaderMiddleware, name="X-Model-Version", value_fn=lambda: "7")
    return TestClient(app)


def test_middleware_requires_the_bearer_key_except_on_health(key_hash):
    client = _client(key_hash)
    for headers in (
        {},
        {"Authorization": KEY},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": "Bearer wrong-key"},
    ):
        resp = client.post("/act", headers=headers, content=b"{}")
        assert resp.status_code == 401, headers
        assert resp.headers["www-authenticate"].startswith("Bearer")
        assert KEY not in resp.text and "wrong-key" not in resp.text
        assert resp.headers["x-model-version"] == "7"
    assert client.get("/healthz").status_code == 200
    ok = client.post("/act", headers={"Authorization": f"Bearer {KEY}"}, content=b"{}")
    assert ok.status_code == 200 and ok.json()["body_len"] == 2


def test_verifier_caches_outcomes_by_digest_not_by_key(key_hash):
    verifier = auth.ApiKeyVerifier(key_hash, negative_cache_size=2)
    assert verifier.cached(KEY) is None
    assert verifier.verify(KEY) and verifier.cached(KEY) is True
    for wrong in ("wrong-1", "wrong-2", "wrong-3"):
        assert not verifier.verify(wrong)
    assert verifier.cached("wrong-3") is False and verifier.cached("wrong-1") is None, "negative cache is bounded"
    assert all(KEY.encode() not in fp for fp in verifier._accepted)


def test_body_limit_rejects_declared_and_streamed_oversize_bodies(key_hash):
    client = _client(key_hash, max_bytes=64)
    auth_header = {"Authorization": f"Bearer {KEY}"}
    big = client.post("/act", headers=auth_header, content=b"x" * 65)
    assert big.status_code == 413 and "64 bytes" in big.json()["error"]
    streamed = client.post("/act", headers=auth_header, content=iter([b"x" * 40, b"x" * 40]))
    assert streamed.status_code == 413
    small_stream = client.post("/act", headers=auth_header, content=iter([b"x" * 20, b"y" * 20]))
    assert small_stream.status_code == 200 and small_stream.json()["body_len"] == 40


def test_non_json_content_type_gets_415(key_hash):
    from opentinker.serving.middleware import JsonBodyMiddleware

    app = Starlette(routes=[Route("/act", _echo, methods=["POST"])])
    app.add_middleware(JsonBodyMiddleware)
    client = TestClient(app)
    resp = client.post("/act", content=b"obs=1", headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert resp.status_code == 415 and "application/json" in resp.json()["error"]
    assert client.post("/act", json={"obs": [1]}).status_code == 200
    assert (
        client.post("/act", content=b"{}", headers={"Content-Type": "application/json; charset=utf-8"}).status_code
        == 200
    )
