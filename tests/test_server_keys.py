"""The server's keys and tenants over HTTP against a real `opentinker server up` process: every route but health
needs a key, keys are hashed at rest and revocable, another tenant's ids answer 404, state survives a restart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

OPENTINKER = str(Path(sys.executable).parent / "opentinker")


def _cli(server, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [OPENTINKER, "server", *args], env={**server.env, "COLUMNS": "200"}, capture_output=True, text=True, timeout=60
    )


def test_health_is_open_and_every_other_route_needs_a_key(api_server):
    health = httpx.get(f"{api_server.url}/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    for method, path in (("GET", "/v1/whoami"), ("GET", "/v1/keys"), ("POST", "/v1/keys"), ("GET", "/v1/tenants")):
        answer = httpx.request(method, f"{api_server.url}{path}")
        assert answer.status_code == 401, (path, answer.text)
        assert answer.headers["www-authenticate"].startswith("Bearer")
        assert "API key" in answer.json()["detail"]


@pytest.mark.parametrize(
    "presented", ["tml-000000000000_wrong", "not-a-key", "tml-", "Bearer", "tml-" + "a" * 300, "tml-zz_ü"]
)
def test_wrong_and_malformed_keys_are_refused(api_server, presented):
    for headers in ({"Authorization": f"Bearer {presented}"}, {"X-API-Key": presented}):
        try:
            answer = httpx.get(f"{api_server.url}/v1/whoami", headers=headers)
        except UnicodeEncodeError:
            continue  # httpx refuses a non-ASCII header before sending
        assert answer.status_code == 401


def test_a_key_works_as_bearer_and_as_x_api_key(api_server):
    key = api_server.make_key("acme", ("jobs", "read"))
    assert key.startswith("tml-")
    for headers in ({"Authorization": f"Bearer {key}"}, {"X-API-Key": key}):
        me = httpx.get(f"{api_server.url}/v1/whoami", headers=headers).json()
        assert me["tenant"] == "acme" and me["scopes"] == ["jobs", "read"] and key.startswith(f"tml-{me['key_id']}_")
    wrong_secret = key[:-3] + ("xyz" if not key.endswith("xyz") else "abc")
    assert httpx.get(f"{api_server.url}/v1/whoami", headers={"X-API-Key": wrong_secret}).status_code == 401


def test_admin_makes_keys_others_may_not(api_server):
    admin = api_server.headers(api_server.admin_key)
    made = httpx.post(
        f"{api_server.url}/v1/keys", headers=admin, json={"tenant": "beta", "scopes": ["read"], "label": "ci"}
    )
    assert made.status_code == 201, made.text
    body = made.json()
    assert body["tenant"] == "beta" and body["scopes"] == ["read"] and body["key"].startswith(f"tml-{body['id']}_")
    beta = api_server.headers(body["key"])
    assert httpx.get(f"{api_server.url}/v1/whoami", headers=beta).json()["tenant"] == "beta"
    refused = httpx.post(f"{api_server.url}/v1/keys", headers=beta, json={"tenant": "beta"})
    assert refused.status_code == 403 and "'admin' scope" in refused.json()["detail"]
    # The listing of a non-admin shows its own tenant's keys only, and never a secret or a hash.
    listed = httpx.get(f"{api_server.url}/v1/keys", headers=beta).json()
    assert {row["tenant"] for row in listed} == {"beta"} and body["id"] in {row["id"] for row in listed}
    assert all(set(row) == {"id", "tenant", "scopes", "label", "created_at", "revoked_at"} for row in listed)
    everyone = httpx.get(f"{api_server.url}/v1/keys", headers=admin).json()
    assert {"ops", "beta"} <= {row["tenant"] for row in everyone}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"tenant": "beta", "scopes": ["jobs", "root"]}, "scope: unknown 'root'"),
        ({"tenant": "Bad Name"}, "tenant: expected"),
        ({"tenant": "beta", "colour": "red"}, "colour: unknown field"),
        ({"scopes": ["read"]}, "tenant: Field required"),
    ],
)
def test_bad_key_requests_name_the_field_and_create_nothing(api_server, body, field):
    admin = api_server.headers(api_server.admin_key)
    before = len(httpx.get(f"{api_server.url}/v1/keys", headers=admin).json())
    answer = httpx.post(f"{api_server.url}/v1/keys", headers=admin, json=body)
    assert answer.status_code == 422 and field in answer.json()["detail"], answer.text
    assert len(httpx.get(f"{api_server.url}/v1/keys", headers=admin).json()) == before


def test_keys_are_stored_only_as_salted_hashes(api_server):
    key = api_server.make_key("hashcheck")
    secret = key.split("_", 1)[1]
    for path in (api_server.data_dir / "server").iterdir():  # the database and its WAL
        assert secret.encode() not in path.read_bytes(), path
    assert secret not in api_server.log.read_text()


def test_cli_creates_lists_and_revokes_and_the_running_server_obeys(api_server):
    made = _cli(api_server, "keys", "create", "--tenant", "cli-tenant", "--scope", "read", "--label", "laptop")
    assert made.returncode == 0, made.stdout + made.stderr
    key = made.stdout.splitlines()[0].strip()
    key_id = key.removeprefix("tml-").split("_")[0]
    assert httpx.get(f"{api_server.url}/v1/whoami", headers={"X-API-Key": key}).status_code == 200
    listed = _cli(api_server, "keys", "list", "--tenant", "cli-tenant")
    assert key_id in listed.stdout and "laptop" in listed.stdout and key.split("_", 1)[1] not in listed.stdout
    revoked = _cli(api_server, "keys", "revoke", key_id)
    assert revoked.returncode == 0 and f"revoked key {key_id}" in revoked.stdout
    assert httpx.get(f"{api_server.url}/v1/whoami", headers={"X-API-Key": key}).status_code == 401
    unknown = _cli(api_server, "keys", "revoke", "000000000000")
    assert unknown.returncode == 1 and "no key with id" in unknown.stdout
    bad = _cli(api_server, "keys", "create", "--tenant", "cli-tenant", "--scope", "superuser")
    assert bad.returncode == 1 and "scope: unknown 'superuser'" in bad.stdout


def test_every_server_command_takes_config_and_none_makes_a_store_where_there_was_none(
    api_server, tmp_path, monkeypatch
):
    """An operator in the wrong folder gets an error naming ``--config``, not a key in a new store no server reads."""
    import os

    from typer.testing import CliRunner

    from opentinker.cli import app as cli
    from opentinker.infra.settings import get_settings

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for name in [k for k in os.environ if k.startswith("OPENTINKER_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OPENTINKER_CONFIG", str(tmp_path / "absent.toml"))  # restored after the CLI's --config
    monkeypatch.setenv("COLUMNS", "300")  # each error on one line
    get_settings.cache_clear()

    def run(*args: str):
        get_settings.cache_clear()
        return CliRunner().invoke(cli, ["server", *args])

    try:
        for args in (("keys", "create", "--tenant", "lost"), ("keys", "list"), ("tenants", "list")):
            refused = run(*args)
            assert refused.exit_code == 2 and "no server database" in refused.output, (args, refused.output)
            assert "--config" in refused.output
        assert "nothing was running" in run("down").output
        assert list(elsewhere.iterdir()) == []  # no .opentinker made on the way
        config = tmp_path / "server.toml"
        config.write_text(f'data_dir = "{api_server.data_dir}"\n')
        made = run("keys", "create", "--tenant", "found", "--scope", "read", "--config", str(config))
        assert made.exit_code == 0, made.output
        key = made.output.splitlines()[0].strip()
        assert httpx.get(f"{api_server.url}/v1/whoami", headers={"X-API-Key": key}).json()["tenant"] == "found"
        assert "found" in run("tenants", "list", "--config", str(config)).output
        missing = run("keys", "list", "--config", str(tmp_path / "nope.toml"))
        assert missing.exit_code == 2 and "no such file" in missing.output
    finally:
        get_settings.cache_clear()


def test_tenants_and_quotas_admin_sets_others_see_only_their_own(api_server):
    admin = api_server.headers(api_server.admin_key)
    updated = httpx.patch(
        f"{api_server.url}/v1/tenants/quota-co", headers=admin, json={"max_running_jobs": 3, "max_gpus": None}
    )
    assert updated.status_code == 200, updated.text
    assert updated.json()["max_running_jobs"] == 3 and updated.json()["max_gpus"] is None
    assert (
        httpx.patch(f"{api_server.url}/v1/tenants/quota-co", headers=admin, json={"max_running_jobs": -1}).status_code
        == 422
    )
    own = api_server.headers(api_server.make_key("quota-co", ("read",)))
    assert httpx.get(f"{api_server.url}/v1/tenants/quota-co", headers=own).json()["max_running_jobs"] == 3
    assert httpx.get(f"{api_server.url}/v1/tenants/ops", headers=own).status_code == 404
    assert httpx.get(f"{api_server.url}/v1/tenants/no-such", headers=own).status_code == 404
    assert httpx.get(f"{api_server.url}/v1/tenants", headers=own).status_code == 403
    assert httpx.patch(f"{api_server.url}/v1/tenants/quota-co", headers=own, json={"max_gpus": 8}).status_code == 403


def test_an_oversized_body_gets_a_readable_413(api_server):
    import urllib.error
    import urllib.request

    admin = api_server.headers(api_server.admin_key)
    body = b"x" * (8 << 20)  # 8 MB against the test server's 2 MB limit; urllib sends it all before reading
    request = urllib.request.Request(
        f"{api_server.url}/v1/keys", data=body, headers={**admin, "Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(request, timeout=60)
    assert answer.value.code == 413 and "at most" in answer.value.read().decode()

    def chunks():  # no Content-Length: the limit holds while streaming too
        for _ in range(8):
            yield b"x" * (1 << 20)

    streamed = httpx.post(f"{api_server.url}/v1/keys", headers=admin, content=chunks())
    assert streamed.status_code == 413
    assert httpx.get(f"{api_server.url}/healthz").status_code == 200


def test_keys_and_tenants_survive_a_killed_server(api_server):
    key = api_server.make_key("survivor", ("read",))
    gone = api_server.make_key("survivor", ("read",))
    admin = api_server.headers(api_server.admin_key)
    gone_id = gone.removeprefix("tml-").split("_")[0]
    assert httpx.delete(f"{api_server.url}/v1/keys/{gone_id}", headers=admin).status_code == 200
    api_server.kill()
    api_server.restart()
    assert httpx.get(f"{api_server.url}/v1/whoami", headers={"X-API-Key": key}).json()["tenant"] == "survivor"
    assert httpx.get(f"{api_server.url}/v1/whoami", headers={"X-API-Key": gone}).status_code == 401


def test_postgresql_by_configuration_keeps_keys_and_tenants_across_a_killed_server(tmp_path):
    """The same server on PostgreSQL (``OPENTINKER_SERVER_DATABASE_URL``): keys and quotas are rows there, hashed,
    and outlive a SIGKILL."""
    import shutil

    import psycopg2
    from fixtures.server import start_test_server

    from opentinker.infra.postgres import cluster_dir, find_bindir, start_postgres

    if find_bindir() is None:
        pytest.skip("PostgreSQL server binaries (Debian `postgresql`) not installed")
    postgres, db_uri = start_postgres(tmp_path / "postgres", tmp_path / "postgres.log")
    try:
        server = start_test_server(
            tmp_path / "server", jobs=False, extra_env={"OPENTINKER_SERVER_DATABASE_URL": db_uri}
        )
        try:
            admin = server.headers(server.admin_key)
            made = httpx.post(f"{server.url}/v1/keys", headers=admin, json={"tenant": "pg-tenant", "scopes": ["read"]})
            key = made.json()["key"]
            httpx.patch(f"{server.url}/v1/tenants/pg-tenant", headers=admin, json={"max_queued_jobs": 7})
            with psycopg2.connect(db_uri.replace("+psycopg2", "")) as connection, connection.cursor() as cursor:
                cursor.execute("SELECT key_hash FROM api_keys WHERE id = %s", (made.json()["id"],))
                (stored,) = cursor.fetchone()
                cursor.execute("SELECT max_queued_jobs FROM tenants WHERE name = 'pg-tenant'")
                assert cursor.fetchone() == (7,)
            assert stored.startswith("scrypt$") and key.split("_", 1)[1] not in stored
            server.kill()
            server.restart()
            assert httpx.get(f"{server.url}/v1/whoami", headers={"X-API-Key": key}).json()["tenant"] == "pg-tenant"
            own = httpx.get(f"{server.url}/v1/tenants/pg-tenant", headers={"X-API-Key": key}).json()
            assert own["max_queued_jobs"] == 7
            assert not (server.data_dir / "server" / "server.db").exists()  # nothing went to SQLite
        finally:
            server.stop()
    finally:
        postgres.stop()
        if cluster_dir(tmp_path / "postgres").parent != tmp_path / "postgres":
            shutil.rmtree(cluster_dir(tmp_path / "postgres"), ignore_errors=True)
