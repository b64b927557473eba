"""The production topology on loopback (tests/fixtures/production.py, docs/deploy.md): PostgreSQL, Prefect, MLflow
with its authentication app over SeaweedFS S3, two API processes behind HAProxy, a worker of its own.

Jobs of two tenants through the load balancer; the API processes killed one at a time mid-job while the client
follows it (nothing lost, the follow uninterrupted); a job probing for MLflow, Prefect and the API from inside its
sandbox; each tenant's MLflow credentials reading its own runs and models only, over HTTP and in headless Chromium;
each tenant's S3 identity, the only one its job holds, reaching its own prefix only; the worker a Unix user of its
own (as root) that reads nothing of the server's.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pwd
import subprocess
import sys
import tarfile
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

SMALL = {"steps": 4096, "num_envs": 4, "eval_episodes": 2, "champion_threshold": 0.0, "ppo": {"n_steps": 64}}
FINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
HTTP = httpx.Client(timeout=120)
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
UI_QUERY = "?workflowType=machine_learning"
SLOW_ENV = '''
"""A slow env (each step sleeps), so the job is still training while the test kills the API processes; it also
probes, once, for what a job must not reach in this topology."""
import json, os, time, urllib.request

import gymnasium as gym
import numpy as np

TARGETS = {targets!r}


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except Exception as exc:
        return type(exc).__name__


class Slow(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self):
        self.t = 0
        if not os.environ.get("PROBED"):
            os.environ["PROBED"] = "1"
            report = {{name: _get(url) for name, url in TARGETS.items()}}
            report["environ"] = sorted(os.environ)
            print("PROBE " + json.dumps(report), flush=True)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {{}}

    def step(self, action):
        time.sleep({sleep})
        self.t += 1
        return np.full(2, 0.1 * int(action), np.float32), float(action), False, self.t >= 20, {{}}
'''


S3_ENV = '''
"""CartPole that prints, once, every S3 variable its job holds: what a hostile env would send home."""
import json, os

from gymnasium.envs.classic_control import CartPoleEnv


class Reporting(CartPoleEnv):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if not os.environ.get("REPORTED"):
            os.environ["REPORTED"] = "1"
            seen = {name: value for name, value in os.environ.items() if "S3" in name or name.startswith("AWS")}
            print("S3-ENV " + json.dumps(seen), flush=True)
'''


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _wait(production, key: str, job_id: str, until, timeout: float = 600.0) -> dict:
    deadline = time.monotonic() + timeout
    status = {}
    while time.monotonic() < deadline:
        answer = HTTP.get(f"{production.url}/v1/jobs/{job_id}", headers=_auth(key))
        status = answer.json()
        if until(status):
            return status
        if status.get("state") in FINAL:
            raise AssertionError(f"job {job_id} ended {status['state']} ({status.get('reason')}) before the condition")
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not get there within {timeout:.0f} s: {status}")


@pytest.fixture(scope="module")
def two_tenants(production):
    """Tenants ``pa`` and ``pb``, a CartPole job each, submitted and followed through the load balancer."""
    from opentinker.server.client import Client

    keys = {tenant: production.make_key(tenant) for tenant in ("pa", "pb")}
    jobs = {
        tenant: Client(production.url, key).submit({"env_id": "CartPole-v1", **SMALL}) for tenant, key in keys.items()
    }
    done = {
        tenant: _wait(production, keys[tenant], job["id"], lambda s: s["state"] in FINAL)
        for tenant, job in jobs.items()
    }
    for status in done.values():
        assert status["state"] == "SUCCEEDED", (status["state"], status.get("reason"), status)
    results = {tenant: Client(production.url, key).result(jobs[tenant]["id"]) for tenant, key in keys.items()}
    dashboards = {tenant: Client(production.url, key).dashboard() for tenant, key in keys.items()}
    return {"keys": keys, "jobs": done, "results": results, "dashboards": dashboards}


def _mlflow_as(dashboard: dict, base: str) -> httpx.Client:
    return httpx.Client(base_url=base, auth=(dashboard["username"], dashboard["password"]), timeout=60)


def test_a_job_of_each_tenant_runs_through_the_load_balancer_and_writes_as_its_tenant(production, two_tenants):
    results, dashboards = two_tenants["results"], two_tenants["dashboards"]
    for tenant in ("pa", "pb"):
        result, dashboard = results[tenant], dashboards[tenant]
        assert result["model_name"].startswith(f"{tenant}.") and result["model_version"] == "1"
        assert dashboard["username"] == f"tenant-{tenant}" and dashboard["url"] == production.mlflow.url
        assert dashboard["experiment_id"] == result["experiment_id"]
        policy = HTTP.get(
            f"{production.url}/v1/jobs/{two_tenants['jobs'][tenant]['id']}/policy",
            headers=_auth(two_tenants["keys"][tenant]),
        )
        assert policy.status_code == 200, policy.text  # the server read the model with the tenant's credentials
        with tarfile.open(fileobj=io.BytesIO(policy.content)) as archive:
            assert {"policy.json", "weights.npz"} <= set(archive.getnames())
        with _mlflow_as(dashboard, production.mlflow.url) as mlflow:
            run = mlflow.get("/api/2.0/mlflow/runs/get", params={"run_id": result["run_id"]}).json()["run"]
            assert run["info"]["experiment_id"] == dashboard["experiment_id"]
            assert {m["key"] for m in run["data"]["metrics"]} >= {"eval/mean_return", "charts/episodic_return_mean"}
    # A policy service of A's model, started by the API process the balancer picks, loads it as tenant-pa.
    key = two_tenants["keys"]["pa"]
    service = HTTP.post(
        f"{production.url}/v1/services", headers=_auth(key), json={"job_id": two_tenants["jobs"]["pa"]["id"]}
    )
    assert service.status_code == 201, service.text
    try:
        act = HTTP.post(
            f"{production.url}/v1/services/{service.json()['id']}/act", headers=_auth(key), json={"obs": [0.0] * 4}
        )
        assert act.status_code == 200 and "action" in act.json(), act.text
    finally:
        HTTP.delete(f"{production.url}/v1/services/{service.json()['id']}", headers=_auth(key))
    # The other tenant's credentials: MLflow itself answers 403 to everything of A's.
    a, b = results["pa"], results["pb"]
    with _mlflow_as(dashboards["pb"], production.mlflow.url) as mlflow:
        for path, params in (
            ("/api/2.0/mlflow/experiments/get", {"experiment_id": a["experiment_id"]}),
            ("/api/2.0/mlflow/runs/get", {"run_id": a["run_id"]}),
            ("/api/2.0/mlflow/registered-models/get", {"name": a["model_name"]}),
            ("/api/2.0/mlflow/model-versions/get", {"name": a["model_name"], "version": a["model_version"]}),
            ("/get-artifact", {"run_uuid": a["run_id"], "path": "plots/learning_curve.png"}),
        ):
            assert mlflow.get(path, params=params).status_code == 403, path
        assert mlflow.get("/api/2.0/mlflow/runs/get", params={"run_id": b["run_id"]}).status_code == 200
    # and B's job result is not A's to read through the server either
    other = HTTP.get(
        f"{production.url}/v1/jobs/{two_tenants['jobs']['pb']['id']}/result",
        headers=_auth(two_tenants["keys"]["pa"]),
    )
    assert other.status_code == 404


def _s3_as(production, access_key: str, secret_key: str):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=production.s3.endpoint_url,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name=production.s3.region,
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )


def _denied(call, **kwargs) -> bool:
    from botocore.exceptions import ClientError

    try:
        call(**kwargs)
    except ClientError as exc:
        return exc.response["Error"]["Code"] == "AccessDenied"
    return False


def test_a_job_holds_its_tenants_s3_identity_only_which_reaches_its_prefix_only(
    production, two_tenants, tmp_path_factory
):
    """A job's env reports the S3 variables it holds: its tenant's own pair and prefix, nothing of the operator's or
    another tenant's. With that pair (from this test's process: the sandbox has no network) the tenant's prefix —
    where the attempt mirrored the job's checkpoint, as the tenant — is readable and writable; another tenant's
    checkpoint and MLflow's artifacts (the operator's prefix) answer AccessDenied."""
    import tomllib

    from opentinker.infra.settings import Settings
    from opentinker.server.client import Client
    from opentinker.server.s3_users import credentials

    key = production.make_key("ps3")
    code = tmp_path_factory.mktemp("s3-env")
    (code / "s3_env").mkdir()
    (code / "s3_env" / "__init__.py").write_text("")
    (code / "s3_env" / "envs.py").write_text(textwrap.dedent(S3_ENV))
    sys.path.insert(0, str(code))
    try:
        job = Client(production.url, key).submit({"env_id": "s3_env.envs:Reporting", **SMALL})
    finally:
        sys.path.remove(str(code))
    final = _wait(production, key, job["id"], lambda s: s["state"] in FINAL)
    assert final["state"] == "SUCCEEDED", final
    logs = HTTP.get(f"{production.url}/v1/jobs/{job['id']}/logs", headers=_auth(key)).text
    reports = [
        json.loads(json.loads(line)["message"].split("S3-ENV ", 1)[1])
        for line in logs.splitlines()
        if "S3-ENV " in line
    ]
    assert reports, logs[-2000:]
    config = tomllib.loads(production.config.read_text())
    secret = Settings(s3_tenant_secret=config["s3_tenant_secret"])
    own, other = credentials("ps3", secret), credentials("pa", secret)
    s3 = production.s3
    for seen in reports:
        assert seen == {
            "OPENTINKER_S3_ENDPOINT_URL": s3.endpoint_url,
            "OPENTINKER_S3_BUCKET": s3.bucket,
            "OPENTINKER_S3_REGION": s3.region,
            "OPENTINKER_S3_ACCESS_KEY": own.access_key,
            "OPENTINKER_S3_SECRET_KEY": own.secret_key,
            "OPENTINKER_S3_PREFIX": "tenants/ps3/",
        }, seen
        assert s3.secret_key not in json.dumps(seen) and other.secret_key not in json.dumps(seen)

    as_job = _s3_as(production, own.access_key, own.secret_key)
    checkpoints = as_job.list_objects_v2(Bucket=s3.bucket, Prefix=f"tenants/ps3/checkpoints/{job['id']}/")
    assert checkpoints.get("KeyCount", 0) >= 1, checkpoints  # the attempt mirrored it, as tenant ps3
    as_job.put_object(Bucket=s3.bucket, Key="tenants/ps3/data/own.txt", Body=b"ps3's")
    assert as_job.get_object(Bucket=s3.bucket, Key="tenants/ps3/data/own.txt")["Body"].read() == b"ps3's"

    as_pa = _s3_as(production, other.access_key, other.secret_key)
    pa_prefix = f"tenants/pa/checkpoints/{two_tenants['jobs']['pa']['id']}/"
    pa_checkpoint = as_pa.list_objects_v2(Bucket=s3.bucket, Prefix=pa_prefix)["Contents"][0]["Key"]
    operator = _s3_as(production, s3.access_key, s3.secret_key)
    mlflow_artifact = operator.list_objects_v2(Bucket=s3.bucket, Prefix="mlflow/")["Contents"][0]["Key"]
    assert _denied(as_job.get_object, Bucket=s3.bucket, Key=pa_checkpoint)
    assert _denied(as_job.put_object, Bucket=s3.bucket, Key=pa_checkpoint, Body=b"overwritten")
    assert _denied(as_job.list_objects_v2, Bucket=s3.bucket, Prefix="tenants/pa/")
    assert _denied(as_job.list_objects_v2, Bucket=s3.bucket, Prefix="tenants/")
    assert _denied(as_job.get_object, Bucket=s3.bucket, Key=mlflow_artifact)
    assert _denied(as_job.list_objects_v2, Bucket=s3.bucket, Prefix="mlflow/")
    assert _denied(as_pa.get_object, Bucket=s3.bucket, Key="tenants/ps3/data/own.txt")
    assert operator.get_object(Bucket=s3.bucket, Key=pa_checkpoint)["Body"].read() != b"overwritten"


def test_the_api_processes_killed_one_at_a_time_mid_job_lose_nothing_and_the_follow_goes_on(
    production, tmp_path_factory
):
    from opentinker.server.client import Client

    key = production.make_key("pk")
    targets = {
        "mlflow": f"{production.mlflow.url}/health",
        "prefect": f"{production.prefect_url}/health",
        "balancer": f"{production.url}/healthz",
        "api0": f"http://127.0.0.1:{production.api_ports[0]}/healthz",
    }
    code = tmp_path_factory.mktemp("slow-env")
    (code / "slow_env").mkdir()
    (code / "slow_env" / "__init__.py").write_text("")
    (code / "slow_env" / "envs.py").write_text(textwrap.dedent(SLOW_ENV.format(targets=targets, sleep=0.03)))
    client = Client(production.url, key)
    sys.path.insert(0, str(code))
    try:
        job = client.submit({"env_id": "slow_env.envs:Slow", **SMALL})
    finally:
        sys.path.remove(str(code))

    updates: list[tuple[float, int]] = []
    final: dict = {}

    def follow() -> None:
        def record(status: dict) -> None:
            if status["state"] == "RUNNING":
                updates.append((time.monotonic(), (status.get("progress") or {}).get("step", 0)))

        final.update(Client(production.url, key).wait(job["id"], on_update=record))

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    _wait(production, key, job["id"], lambda s: (s.get("progress") or {}).get("step", 0) > 0, timeout=600)
    # A steady client of GETs through the balancer while the processes die: an in-flight GET is retried on the other.
    steady: dict[str, list] = {"answers": [], "failures": []}
    killing = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=30, headers=_auth(key)) as steady_http:
            while not killing.is_set() and len(steady["answers"]) < 20_000:
                try:
                    steady["answers"].append(steady_http.get(f"{production.url}/v1/jobs/{job['id']}").status_code)
                except httpx.HTTPError as exc:
                    steady["failures"].append(repr(exc))
                time.sleep(0.05)  # steady, not a flood: ~20 GETs a second

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    for index in (0, 1):
        killed_at = time.monotonic()
        production.kill_api(index)
        for _ in range(10):  # the balancer answers throughout, from the process still up
            assert HTTP.get(f"{production.url}/healthz").status_code == 200
            time.sleep(0.3)
        status = _wait(
            production, key, job["id"], lambda s, t=killed_at: any(at > t + 2 and step > 0 for at, step in updates)
        )
        assert status["state"] == "RUNNING", f"the job must still run while API process {index} is down: {status}"
        production.start_api(index)
    killing.set()
    poller.join(timeout=60)
    assert steady["failures"] == [], steady["failures"][:5]
    assert len(steady["answers"]) > 20 and set(steady["answers"]) == {200}, sorted(set(steady["answers"]))
    follower.join(timeout=600)
    assert final.get("state") == "SUCCEEDED", final
    assert final["attempts"] == 1, final  # no attempt lost or re-queued
    assert Client(production.url, key).result(job["id"])["model_version"] == "1"
    steps = [step for _, step in updates]
    assert steps == sorted(steps) and steps[-1] > 0, steps  # one uninterrupted, monotonic follow

    logs = HTTP.get(f"{production.url}/v1/jobs/{job['id']}/logs", headers=_auth(key)).text
    probes = [
        json.loads(json.loads(line)["message"].split("PROBE ", 1)[1]) for line in logs.splitlines() if "PROBE " in line
    ]
    assert probes, logs[-2000:]
    for report in probes:
        # no network in the sandbox: neither MLflow, nor Prefect, nor the API, nor the balancer
        assert {report[name] for name in targets} == {"URLError"}, report
        assert not any(name.startswith(("MLFLOW", "PREFECT", "AWS", "OPENTINKER_MLFLOW")) for name in report["environ"])


READ_AS_WORKER = """
import json, os, sys

seen = {}
for path in sys.argv[1:]:
    try:
        if os.path.isdir(path):
            seen[path] = "listed:" + str(len(os.listdir(path)))
        else:
            with open(path, "rb") as file:
                seen[path] = "read:" + str(len(file.read(64)))
    except OSError as exc:
        seen[path] = type(exc).__name__
print(json.dumps(seen))
"""


def test_the_worker_is_a_user_of_its_own_that_reads_nothing_of_the_servers(production, two_tenants):
    """The worker, and every attempt it ran, is its own Unix user: its jobs' folders are that user's; as that user,
    the server's config (the database password, MLflow's and S3's admins), PostgreSQL's password and files (the key
    store), the API's own folder and homes are out of reach, while its key and the tenants' folders are not."""
    import psutil

    from opentinker.infra.postgres import cluster_dir

    if not production.worker_user:
        pytest.skip("the worker runs as a user of its own only where the session is root (it makes the user)")
    user = pwd.getpwnam(production.worker_user)
    worker = next(service for service in production.started if service.name == "worker")
    assert psutil.Process(worker.pid).uids().real == user.pw_uid
    job_dir = production.data_dir / "tenants" / "pa" / "runs" / two_tenants["jobs"]["pa"]["id"]
    assert job_dir.stat().st_uid == user.pw_uid  # the attempt wrote it, as the worker's user
    secret = [
        production.config,
        production.root / "postgres" / "credentials.json",
        cluster_dir(production.root / "postgres"),
        production.data_dir / "server",
        production.root / "api-0",
    ]
    own = [production.root / "worker" / "worker.key", production.data_dir / "tenants" / "pa"]
    as_worker = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--"]
    answer = subprocess.run(
        [*as_worker, sys.executable, "-c", READ_AS_WORKER, *map(str, [*secret, *own])],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
        cwd="/",
        check=True,
    )
    seen = json.loads(answer.stdout)
    assert {str(path): seen[str(path)] for path in secret} == dict.fromkeys(map(str, secret), "PermissionError"), seen
    assert seen[str(own[0])].startswith("read:") and seen[str(own[1])].startswith("listed:"), seen


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium through the system chromedriver (Selenium Manager offline)."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.fail("chromium and chromium-driver are missing: run ./install.sh as root (or apt-get install them)")
    os.environ["SE_OFFLINE"] = "true"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _sign_in(driver, dashboard: dict) -> None:
    """Every request of the browser carries the tenant's MLflow user (what a browser sends after the basic-auth
    prompt)."""
    token = base64.b64encode(f"{dashboard['username']}:{dashboard['password']}".encode()).decode()
    driver.get("about:blank")  # a fresh page load: the UI fetches its user again (a hash change would not)
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {token}"}})


def _shows(driver, url: str, *texts: str, any_of: tuple[str, ...] = ()) -> str:
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url)
    body = ""

    def ready(d) -> bool:
        nonlocal body
        body = d.find_element("tag name", "body").text
        return all(text in body for text in texts) and (not any_of or any(text in body for text in any_of))

    try:
        WebDriverWait(driver, 90, poll_frequency=0.5).until(ready)
    except Exception:
        raise AssertionError(f"{url} never showed {texts} {any_of}; it showed:\n{body[:3000]}") from None
    return body


def test_each_tenants_dashboard_shows_its_run_curves_and_model_and_not_the_others(
    production, two_tenants, browser, tmp_path_factory
):
    shots = Path(os.environ.get("OPENTINKER_SCREENSHOT_DIR") or tmp_path_factory.mktemp("dashboard-shots"))
    shots.mkdir(parents=True, exist_ok=True)
    dashboards, results, jobs = two_tenants["dashboards"], two_tenants["results"], two_tenants["jobs"]
    for tenant, other in (("pa", "pb"), ("pb", "pa")):
        dashboard, result = dashboards[tenant], results[tenant]
        _sign_in(browser, dashboard)
        _shows(browser, dashboard["experiment_url"], f"tenant-{tenant}", jobs[tenant]["id"])
        browser.save_screenshot(str(shots / f"tenant-{tenant}-experiment.png"))
        run_page = f"{dashboard['url']}/#/experiments/{dashboard['experiment_id']}/runs/{result['run_id']}"
        _shows(browser, f"{run_page}/model-metrics{UI_QUERY}", "episodic_return_mean", "Step")
        browser.save_screenshot(str(shots / f"tenant-{tenant}-curves.png"))
        models = _shows(browser, dashboard["models_url"], result["model_name"])
        assert results[other]["model_name"] not in models
        browser.save_screenshot(str(shots / f"tenant-{tenant}-models.png"))
        other_id = results[other]["experiment_id"]
        page = _shows(browser, f"{dashboard['url']}/#/experiments/{other_id}{UI_QUERY}", f"tenant-{tenant}")
        time.sleep(5)  # what the page shows once its requests have answered
        browser.save_screenshot(str(shots / f"tenant-{tenant}-other-experiment.png"))
        page = browser.find_element("tag name", "body").text
        assert jobs[other]["id"] not in page and f"tenant-{other}" not in page, page
        status = browser.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            f"fetch('/ajax-api/2.0/mlflow/experiments/get?experiment_id={other_id}').then(r => done(r.status));"
        )
        assert status == 403  # the browser's own session, asking MLflow for the other tenant's experiment


def test_a_model_name_another_tenant_made_first_fails_the_job_naming_it(production, two_tenants):
    """Tenant pa, with its dashboard credentials, makes the registered model tenant psq's job will register and
    grants psq on it (to read what psq's job would write): the job fails at launch, naming it, and writes nothing."""
    from opentinker.server.client import Client

    key = production.make_key("psq")
    with _mlflow_as(two_tenants["dashboards"]["pa"], production.mlflow.url) as mlflow:
        assert mlflow.post("/api/2.0/mlflow/registered-models/create", json={"name": "psq.cartpole"}).status_code == 200
        grant = {"username": "tenant-psq", "resource_type": "registered_model", "resource_id": "psq.cartpole"}
        mlflow.post("/api/3.0/mlflow/users/permissions/grant", json={**grant, "permission": "READ"})
    job = Client(production.url, key).submit({"env_id": "CartPole-v1", "model_name": "cartpole", **SMALL})
    final = _wait(production, key, job["id"], lambda s: s["state"] in FINAL, timeout=300)
    assert final["state"] == "FAILED" and "'psq.cartpole' was made by another MLflow user" in final["reason"], final
    with _mlflow_as(two_tenants["dashboards"]["pa"], production.mlflow.url) as mlflow:
        versions = mlflow.get("/api/2.0/mlflow/registered-models/get", params={"name": "psq.cartpole"}).json()
        assert not versions["registered_model"].get("latest_versions"), versions


def _served_by_api(production) -> dict[str, int]:
    """Requests each API process has taken (HAProxy's ``stot`` per server)."""
    rows = [row.split(",") for row in HTTP.get(f"{production.url}/lb-stats;csv").text.splitlines()]
    column = rows[0].index("stot")
    return {row[1]: int(row[column]) for row in rows[1:] if row[0] == "opentinker" and row[1].startswith("api")}


def test_a_tinker_client_trains_through_the_load_balancer_on_one_engine_on_the_operators_ray(production, two_tenants):
    """The official SDK through HAProxy: both API processes take its calls and reach one engine, an actor on the
    topology's own Ray cluster (2 nodes; no API started a head of its own), which holds no operator credential; the
    run lands in the tenant's MLflow experiment, read with the tenant's own MLflow user; the other tenant's SDK cannot
    load the checkpoint."""
    import numpy as np
    import tinker
    from fixtures.tinker import TINY
    from tinker import types

    from opentinker.infra.settings import Settings
    from opentinker.server.tinker.remote import ACTOR_NAME, namespace

    before = _served_by_api(production)
    with tinker.ServiceClient(base_url=production.url, api_key=two_tenants["keys"]["pa"]) as service:
        training = service.create_lora_training_client(base_model=TINY, rank=4, seed=1).result()
        tokens = training.get_tokenizer().encode("The quick brown fox jumps over the lazy dog while the cat sleeps.")
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": np.ones(len(tokens) - 1, np.float32)},
        )
        losses = []
        for _ in range(3):
            loss = training.forward_backward([datum], "cross_entropy")
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            losses.append(loss.result().metrics["loss:sum"])
        assert losses[-1] < losses[0], losses
        saved = training.save_state("through-the-balancer").result().path
        after = _served_by_api(production)
        assert all(after[name] > before[name] for name in before), (before, after)  # both took the client's calls
        assert not (production.data_dir / "server" / "ray" / "state.json").exists()  # no head of an API's own

        space = namespace(Settings(data_dir=production.data_dir))
        probe = (
            "import json, ray\n"
            f"ray.init(address={production.ray.address!r}, namespace={space!r})\n"
            f"engine = ray.get_actor({ACTOR_NAME!r})\n"
            "held = ray.get(engine.__ray_call__.remote(lambda actor: actor.settings.model_dump(mode='json')))\n"
            "print(json.dumps([len([n for n in ray.nodes() if n['Alive']]), held]))\n"
        )
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-2000:]
        nodes, held = json.loads(done.stdout.strip().splitlines()[-1])
        assert nodes == 2
        secrets = ("mlflow_admin_password", "mlflow_tenant_secret", "s3_admin_secret_key")
        assert not [name for name in secrets if held[name]]  # names only: a failure must not print the secrets

        with _mlflow_as(two_tenants["dashboards"]["pa"], production.mlflow.url) as mlflow:
            query = {"experiment_ids": [two_tenants["dashboards"]["pa"]["experiment_id"]], "max_results": 50}
            runs = mlflow.post("/api/2.0/mlflow/runs/search", json=query).json()["runs"]
            tags = [{t["key"]: t["value"] for t in run["data"].get("tags", [])} for run in runs]
            assert any(t.get("tinker.model_id") == training.model_id for t in tags), tags
        with tinker.ServiceClient(base_url=production.url, api_key=two_tenants["keys"]["pb"]) as other:
            with pytest.raises(tinker.RequestFailedError, match="no such checkpoint"):
                other.create_training_client_from_state(saved).result()
