"""The policy service over real HTTP: one ``bentoml serve`` process per session (fixtures/serving.py)."""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import numpy as np
import pytest
from fixtures.serving import SERVER_SETTINGS, SERVING_API_KEY

from opentinker.tracking import registry as model_store

pytestmark = pytest.mark.slow  # starts real services or trains through a flow

AUTH = {"Authorization": f"Bearer {SERVING_API_KEY}"}


@pytest.fixture(scope="module")
def http(policy_server):
    with httpx.Client(base_url=policy_server.url, timeout=30) as client:
        yield client


def _random_obs(policy, n: int, seed: int) -> np.ndarray:
    space = policy.observation_space
    low, high = np.maximum(space.low, -3.0), np.minimum(space.high, 3.0)
    return np.random.default_rng(seed).uniform(low, high, size=(n, *space.shape)).astype(space.dtype)


def _act(http, obs, **extra) -> httpx.Response:
    return http.post("/act", json={"obs": np.asarray(obs).tolist(), **extra}, headers=AUTH)


def test_actions_equal_the_in_process_policy(http, policy_server, registered_policies):
    obs = _random_obs(registered_policies.policy("1"), 64, seed=0)
    batch = http.post("/act_batch", json={"obs": obs.tolist()}, headers=AUTH)
    assert batch.status_code == 200, batch.text
    version = batch.headers["x-model-version"]
    expected = registered_policies.policy(version)
    np.testing.assert_array_equal(np.asarray(batch.json()), expected.act(obs))
    for row in obs[:16]:
        resp = _act(http, row)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["action"] == int(registered_policies.policy(body["model_version"]).act(row[None])[0])
        assert resp.headers["x-model-version"] == body["model_version"]
    np.testing.assert_array_equal(policy_server.predict_batch(obs[:8]), expected.act(obs[:8]))
    assert policy_server.predict(obs[0]) == int(expected.act(obs[:1])[0])


def test_return_info_gives_the_policy_probabilities_and_value(http, registered_policies):
    obs = _random_obs(registered_policies.policy("1"), 1, seed=1)[0]
    body = _act(http, obs, return_info=True).json()
    actions, probs, values = registered_policies.policy(body["model_version"]).act_with_info(obs[None])
    assert body["action"] == int(actions[0])
    np.testing.assert_allclose(body["probs"], probs[0], rtol=1e-6)
    assert body["value"] == pytest.approx(float(values[0]), rel=1e-5)


def test_metadata_describes_what_is_served(http, registered_policies):
    meta = http.post("/metadata", json={}, headers=AUTH).json()
    assert meta["model_name"] == registered_policies.name
    assert meta["run_id"] == registered_policies.run_ids[meta["model_version"]]
    assert meta["env_id"] == "CartPole-v1" and meta["algorithm"] == "ppo" and meta["served_action"] == "greedy"
    assert meta["observation_space"]["shape"] == [4] and meta["observation_space"]["dtype"] == "float32"
    assert meta["observation_space"]["high"][1] is None, "infinite bounds are reported as null"
    assert meta["action_space"]["repr"] == "Discrete(2)"


@pytest.mark.parametrize("path", ["/act", "/act_batch", "/metadata", "/reload", "/docs.json"])
def test_every_endpoint_but_health_requires_the_key(http, path, policy_server):
    body = {"obs": [0.0, 0.0, 0.0, 0.0]}
    for headers in ({}, {"Authorization": "Bearer wrong-key-123"}, {"Authorization": f"Token {SERVING_API_KEY}"}):
        resp = http.request("POST" if path != "/docs.json" else "GET", path, json=body, headers=headers)
        assert resp.status_code == 401, (path, headers, resp.status_code)
        assert SERVING_API_KEY not in resp.text and "wrong-key-123" not in resp.text
        assert resp.headers["x-model-version"], "even a 401 says which version is served"
    for health in ("/healthz", "/livez", "/readyz"):
        assert http.get(health).status_code == 200


def test_keys_never_reach_the_log_or_the_server_environment(http, policy_server):
    _act(http, [0.0, 0.0, 0.0, 0.0])
    http.post("/act", json={"obs": [0.0] * 4}, headers={"Authorization": "Bearer wrong-key-456"})
    log = policy_server.log_path.read_text()
    assert SERVING_API_KEY not in log and "wrong-key-456" not in log
    with open(f"/proc/{policy_server.process.pid}/environ", "rb") as fh:
        assert SERVING_API_KEY.encode() not in fh.read()


BAD_REQUESTS = [
    ("wrong shape", {"json": {"obs": [0.0, 0.0, 0.0]}}, 400, "expected shape (4,), got (3,)"),
    ("nested shape", {"json": {"obs": [[0.0, 0.0, 0.0, 0.0]]}}, 400, "expected shape (4,), got (1, 4)"),
    ("ragged", {"json": {"obs": [0.0, [0.0], 0.0, 0.0]}}, 400, "rectangular"),
    ("wrong dtype", {"json": {"obs": ["a", "b", "c", "d"]}}, 400, "expected numbers (float32)"),
    ("null", {"json": {"obs": None}}, 400, "expected numbers"),
    ("NaN", {"content": b'{"obs": [NaN, 0.0, 0.0, 0.0]}'}, 400, "obs[0] = nan: expected a finite number"),
    ("inf", {"content": b'{"obs": [0.0, 1e999, 0.0, 0.0]}'}, 400, "obs[1] = inf: expected a finite number"),
    (
        "out of bounds",
        {"json": {"obs": [0.0, 0.0, 3.0, 0.0]}},
        400,
        "obs[2] = 3.0: expected a value within [-0.41887903, 0.41887903]",
    ),
    ("missing field", {"json": {"observation": [0.0] * 4}}, 400, "Field required"),
    ("non-JSON", {"content": b"obs=1,2,3,4"}, 400, "Invalid JSON"),
    ("truncated JSON", {"content": b'{"obs": [0.0, 0.0'}, 400, "Invalid JSON"),
    (
        "form body",
        {"content": b"obs=1", "headers": {"Content-Type": "application/x-www-form-urlencoded"}},
        415,
        "expected application/json",
    ),
    (
        "oversized",
        {"content": b'{"obs": [' + b"0.0," * 20_000 + b"0.0]}"},
        413,
        f"at most {SERVER_SETTINGS['max_body_bytes']} bytes",
    ),
]


@pytest.mark.parametrize("case, request_kwargs, status, message", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_gets_a_4xx_naming_the_field_and_the_server_keeps_serving(
    http, case, request_kwargs, status, message
):
    headers = {"Content-Type": "application/json", **AUTH, **request_kwargs.pop("headers", {})}
    resp = http.post("/act", headers=headers, **request_kwargs)
    assert resp.status_code == status, resp.text
    assert message in resp.text
    if status == 400 and "JSON" not in case:
        assert [d["loc"] for d in resp.json()["detail"]] == [["obs"]], "the error names the field"
    assert _act(http, [0.01, 0.0, 0.0, 0.0]).status_code == 200


def test_an_8_mb_body_gets_a_413_the_client_can_read(policy_server):
    """A client that sends its whole body before reading (urllib, requests) used to see a broken pipe or a reset
    connection: the server answered early and closed with the body unread. Now it drains the body first."""
    import urllib.error
    import urllib.request

    body = b'{"obs": [' + b"0.0," * (2 << 20) + b"0.0]}"  # 8 MB
    request = urllib.request.Request(
        f"{policy_server.url}/act", data=body, headers={"Content-Type": "application/json", **AUTH}
    )
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(request, timeout=60)
    assert answer.value.code == 413
    assert f"at most {SERVER_SETTINGS['max_body_bytes']} bytes" in answer.value.read().decode()


def test_batch_validation_is_per_request_and_bounded(http):
    bad_row = http.post("/act_batch", json={"obs": [[0.0] * 4, [0.0, 0.0, 9.0, 0.0]]}, headers=AUTH)
    assert bad_row.status_code == 400 and "obs[1][2] = 9.0" in bad_row.text
    too_many = http.post(
        "/act_batch", json={"obs": [[0.0] * 4] * (SERVER_SETTINGS["max_batch_size"] + 1)}, headers=AUTH
    )
    assert too_many.status_code == 400 and f"at most {SERVER_SETTINGS['max_batch_size']} observations" in too_many.text
    empty = http.post("/act_batch", json={"obs": []}, headers=AUTH)
    assert empty.status_code == 400
    assert http.post("/act_batch", json={"obs": [[0.0] * 4] * 3}, headers=AUTH).status_code == 200


def test_concurrent_batches_are_merged_without_mixing_results(http, registered_policies):
    obs = _random_obs(registered_policies.policy("1"), 6 * 5, seed=7).reshape(6, 5, 4)
    results: list = [None] * len(obs)

    def call(i):
        with httpx.Client(base_url=str(http.base_url), timeout=30) as client:
            resp = client.post("/act_batch", json={"obs": obs[i].tolist()}, headers=AUTH)
            results[i] = (resp.headers["x-model-version"], resp.json())

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(obs))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for i, (version, actions) in enumerate(results):
        np.testing.assert_array_equal(actions, registered_policies.policy(version).act(obs[i]))


def _stalled_request(url: str) -> socket.socket:
    """An authenticated request whose body never arrives: it holds a concurrency slot until the timeout."""
    parsed = urlparse(url)
    sock = socket.create_connection((parsed.hostname, parsed.port))
    sock.sendall(
        b"POST /act HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
        + f"Authorization: Bearer {SERVING_API_KEY}\r\n\r\n".encode()
    )
    return sock


def test_concurrency_limit_answers_429_and_slow_requests_time_out(http, policy_server):
    stalled = [_stalled_request(policy_server.url) for _ in range(SERVER_SETTINGS["max_concurrency"])]
    try:
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:  # wait until every stalled request holds its slot
            resp = _act(http, [0.0] * 4)
            if resp.status_code == 429:
                break
            time.sleep(0.05)
        assert resp.status_code == 429, resp.text
        stalled[0].settimeout(SERVER_SETTINGS["timeout_s"] + 10)
        assert stalled[0].recv(200).startswith(b"HTTP/1.1 504")
    finally:
        for sock in stalled:
            sock.close()
    deadline = time.monotonic() + SERVER_SETTINGS["timeout_s"] + 5
    while _act(http, [0.0] * 4).status_code != 200:
        assert time.monotonic() < deadline, "server did not recover from the stalled requests"
        time.sleep(0.2)


def _wait_for_version(http, version: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (current := _act(http, [0.0] * 4).headers["x-model-version"]) != version:
        assert time.monotonic() < deadline, f"still serving {current}, expected {version}"
        time.sleep(0.2)


def test_alias_move_is_picked_up_without_dropping_requests(http, policy_server, registered_policies):
    name = registered_policies.name
    obs = _random_obs(registered_policies.policy("1"), 32, seed=5)
    statuses: list[int] = []
    stop = threading.Event()

    def hammer():
        with httpx.Client(base_url=policy_server.url, timeout=30) as client:
            while not stop.is_set():
                statuses.append(client.post("/act_batch", json={"obs": obs.tolist()}, headers=AUTH).status_code)

    worker = threading.Thread(target=hammer)
    worker.start()
    try:
        model_store.set_alias(name, "champion", "2")
        _wait_for_version(http, "2")
    finally:
        stop.set()
        worker.join()
    assert statuses and set(statuses) == {200}, f"dropped or failed requests during reload: {set(statuses)}"
    resp = http.post("/act_batch", json={"obs": obs.tolist()}, headers=AUTH)
    np.testing.assert_array_equal(resp.json(), registered_policies.policy("2").act(obs))

    model_store.set_alias(name, "champion", "1")
    reloaded = http.post("/reload", json={}, headers=AUTH).json()
    assert reloaded["current"] == "1" and reloaded["error"] is None
    assert _act(http, obs[0]).headers["x-model-version"] == "1"


def test_a_version_with_other_spaces_is_refused_and_the_old_one_kept(http, registered_policies):
    name = registered_policies.name
    model_store.set_alias(name, "champion", registered_policies.incompatible_version)
    try:
        result = http.post("/reload", json={}, headers=AUTH).json()
        assert result["current"] == "1" and "observation space changed" in result["error"]
        assert http.post("/metadata", json={}, headers=AUTH).json()["last_reload_error"]
        assert _act(http, [0.0] * 4).status_code == 200
    finally:
        model_store.set_alias(name, "champion", "1")
    assert http.post("/reload", json={}, headers=AUTH).json()["error"] is None


def test_openapi_schema_is_served_to_authenticated_clients(http):
    schema = http.get("/docs.json", headers=AUTH).json()
    assert {"/act", "/act_batch", "/metadata", "/reload"} <= set(schema["paths"])
    assert json.dumps(schema).count("model_version") >= 1
