"""Jobs on a real `opentinker server up` (its Prefect server and sandboxed worker, MLflow, over HTTP): two tenants each
train, see only their own, the other's ids answer 404 on every route; a hostile env reaches nothing of the server or
of the other tenant; quotas answer 429; bad submissions answer 4xx naming the field and create nothing."""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import httpx
import numpy as np
import pytest
from fixtures.server import CANARY, wait_for_job

pytestmark = pytest.mark.slow

SMALL = {"steps": 4096, "num_envs": 4, "eval_episodes": 2, "champion_threshold": 0.0, "ppo": {"n_steps": 64}}
"""A CartPole job that runs in seconds (tests check the plumbing, not the learning)."""
FINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
HTTP = httpx.Client(timeout=120)
"""Submits and first calls of a tenant make Prefect objects: on a loaded machine that takes seconds."""

PROBE_ENV = '''
"""A user's env that also tries to read what it must not (written by the test; its paths are the attacker's guesses)."""
import json, os
from pathlib import Path

import gymnasium as gym
import numpy as np

TARGETS = {targets!r}
SERVER = {server!r}
PREFECT = {prefect!r}
ESCAPE = {escape!r}


def _try(path):
    try:
        if Path(path).is_dir():
            return "listed:" + ",".join(sorted(os.listdir(path)))
        return "read:%d" % len(Path(path).read_bytes())
    except Exception as exc:
        return type(exc).__name__


def _get(url, body=None):
    """What an HTTP request from inside the job gets: its status, or the error that stopped it."""
    import base64
    import urllib.request

    token = base64.b64encode(os.environ.get("PREFECT_API_AUTH_STRING", "").encode()).decode()
    headers = {{"Authorization": "Basic " + token, "Content-Type": "application/json"}}
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except Exception as exc:
        return type(exc).__name__


def _written_outside():
    """Folders outside its scratch, /tmp and /dev/shm where this process could create a file (the sandbox's own
    tmpfs stubs allow it; the test checks that none of those files reached the host)."""
    written = []
    for top in ("/", "/run", "/var", "/home", "/root", "/srv", "/opt", "/usr", "/etc", "/work"):
        for root, dirs, _ in os.walk(top):
            dirs[:] = [d for d in dirs if os.path.join(root, d) not in ("/proc", "/sys", "/dev", "/tmp", "/job")]
            try:
                Path(root, ESCAPE).write_text("x")
                written.append(root)
            except OSError:
                pass
            if root.count("/") > 3:
                dirs[:] = []
    return written


def _poison_store():
    """The old attack: an SQLite trigger in a store the job writes, rewriting model sources to another tenant's files.
    The job's only store now is this scratch file, which no trusted code opens."""
    import sqlite3

    path = Path(os.environ.get("OPENTINKER_DATA_DIR", "/tmp")) / "mlflow.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE IF NOT EXISTS model_versions (source TEXT)")
        db.execute(
            "CREATE TRIGGER IF NOT EXISTS steal AFTER INSERT ON model_versions BEGIN "
            "UPDATE model_versions SET source = '%s'; END" % TARGETS["alpha_dir"]
        )
    return str(path)


def _plant_link(victim, path):
    """Try to replace ``path`` (the tenant's uploads folder, as the attacker guesses it) with a link to ``victim``."""
    try:
        os.symlink(victim, path)
        return "planted"
    except Exception as exc:
        return type(exc).__name__


class Probe(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self):
        self.t = 0
        if os.environ.get("PROBED"):  # once per process: the env is built for each copy
            return
        os.environ["PROBED"] = "1"
        report = {{name: _try(path) for name, path in TARGETS.items()}}
        report["proc_environs"] = [_try(f"/proc/{{pid}}/environ") for pid in os.listdir("/proc") if pid.isdigit()]
        report["server_api"] = _get(SERVER + "/healthz")
        report["prefect_direct"] = _get(PREFECT + "/health")
        report["prefect_loopback"] = _get("http://127.0.0.1:4200/api/flow_runs/filter", b"{{}}")
        report["written"] = _written_outside()
        report["link"] = _plant_link(TARGETS["alpha_dir"], TARGETS["beta_uploads"])
        report["poisoned"] = _poison_store()
        report["sockets"] = [p for p in ("/run/opentinker", "/run/opentinker/api.sock") if os.path.exists(p)]
        for key, value in report.items():  # the job's output reaches its log, line by line: the test reads it there
            print("PROBE", key, json.dumps(value)[:1500], flush=True)
        for key, value in os.environ.items():
            print("PROBE-ENV", key, json.dumps(value)[:200], flush=True)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {{}}

    def step(self, action):
        self.t += 1
        return np.full(2, 0.1 * int(action), np.float32), float(action), False, self.t >= 20, {{}}
'''


def _package(root: Path, name: str, files: dict[str, str]) -> Path:
    """A package ``name`` written under ``root`` (a temp dir the server never has on its path)."""
    pkg = root / name
    pkg.mkdir(parents=True)
    for filename, text in {"__init__.py": "", **files}.items():
        (pkg / filename).write_text(textwrap.dedent(text))
    return pkg


def _tar(members: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            archive.addfile(info)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def tenants(job_server, tmp_path_factory):
    """Two tenants and their finished jobs: ``alpha`` trained CartPole-v1; ``beta`` its own env, uploaded from a temp
    dir, whose constructor probes for the key store, alpha's files and the server's environment."""
    from opentinker.server.client import Client

    server = job_server
    alpha_key, beta_key = server.make_key("alpha"), server.make_key("beta")
    alpha, beta = Client(server.url, alpha_key), Client(server.url, beta_key)
    alpha_dir = server.data_dir / "tenants" / "alpha"
    targets = {
        "key_store": str(server.data_dir / "server" / "server.db"),
        "worker_key": str(server.data_dir / "server" / "worker.key"),
        "server_dir": str(server.data_dir / "server"),
        "data_dir": str(server.data_dir),
        "alpha_store": str(alpha_dir / "mlflow.db"),
        "alpha_dir": str(alpha_dir),
        "etc_shadow": "/etc/shadow",
        "root_home": "/root",
        "beta_uploads": str(server.data_dir / "tenants" / "beta" / "uploads"),
    }
    code = tmp_path_factory.mktemp("beta-code")
    _package(
        code,
        "probe_env",
        {
            "envs.py": PROBE_ENV.format(
                targets=targets, server=server.url, prefect=f"{server.prefect_url}/api", escape=ESCAPE
            )
        },
    )

    sys.path.insert(0, str(code))  # the client packs the package from where the user has it
    try:
        alpha_job = alpha.submit({"env_id": "CartPole-v1", **SMALL})
        beta_job = beta.submit({"env_id": "probe_env.envs:Probe", **SMALL})
    finally:
        sys.path.remove(str(code))
    done = {
        "alpha": wait_for_job(server, alpha_key, alpha_job["id"], lambda s: s["state"] in FINAL),
        "beta": wait_for_job(server, beta_key, beta_job["id"], lambda s: s["state"] in FINAL),
    }
    assert done["alpha"]["state"] == "SUCCEEDED", done["alpha"]
    assert done["beta"]["state"] == "SUCCEEDED", done["beta"]
    # The same job as alpha's, alone (no attacker beside it), for the weights alpha's job must end with.
    gamma_key = server.make_key("gamma")
    gamma_job = Client(server.url, gamma_key).submit({"env_id": "CartPole-v1", **SMALL})
    done["gamma"] = wait_for_job(server, gamma_key, gamma_job["id"], lambda s: s["state"] in FINAL)
    assert done["gamma"]["state"] == "SUCCEEDED", done["gamma"]
    keys = {"alpha": alpha_key, "beta": beta_key, "gamma": gamma_key}
    return {"server": server, "keys": keys, "jobs": done, "alpha_dir": alpha_dir}


def test_each_tenant_trains_and_sees_only_its_own(tenants):
    server, keys, jobs = tenants["server"], tenants["keys"], tenants["jobs"]
    run_ids = {}
    for tenant, other in (("alpha", "beta"), ("beta", "alpha")):
        listed = HTTP.get(f"{server.url}/v1/jobs", headers=server.headers(keys[tenant])).json()
        ids = {job["id"] for job in listed}
        assert jobs[tenant]["id"] in ids and jobs[other]["id"] not in ids
        result = HTTP.get(f"{server.url}/v1/jobs/{jobs[tenant]['id']}/result", headers=server.headers(keys[tenant]))
        assert result.status_code == 200, result.text
        body = result.json()
        assert body["model_name"].startswith(f"{tenant}.") and body["model_version"] == "1"
        assert body["decision"].startswith("promoted") and body["global_step"] >= SMALL["steps"]
        run_ids[tenant] = body["run_id"]
    # Each tenant's runs and models are in its own MLflow store and experiment.
    import mlflow

    for tenant in ("alpha", "beta"):
        store = f"sqlite:///{server.data_dir / 'tenants' / tenant / 'mlflow.db'}"
        client = mlflow.MlflowClient(tracking_uri=store, registry_uri=store)
        names = [model.name for model in client.search_registered_models()]
        assert names and all(name.startswith(f"{tenant}.") for name in names)
        assert client.get_experiment_by_name(f"tenant-{tenant}") is not None
        metrics = client.get_run(run_ids[tenant]).data.metrics  # the learner's figures, sampled in its sandbox
        assert metrics["charts/sps"] > 0 and metrics["perf/memory_rss_mb"] > 50
    assert jobs["beta"]["env_id"] == "probe_env.envs:Probe"


OTHER_TENANT_ROUTES = [
    ("GET", "/v1/jobs/{id}", None),
    ("GET", "/v1/jobs/{id}/result", None),
    ("GET", "/v1/jobs/{id}/policy", None),
    ("GET", "/v1/jobs/{id}/logs", None),
    ("GET", "/v1/jobs/{id}/events", None),
    ("POST", "/v1/jobs/{id}/cancel", None),
    ("POST", "/v1/jobs/{id}/resume", None),
    ("POST", "/v1/services", {"job_id": "{id}"}),
]


@pytest.mark.parametrize(
    ("method", "path", "body"), OTHER_TENANT_ROUTES, ids=[f"{m} {p}" for m, p, _ in OTHER_TENANT_ROUTES]
)
def test_another_tenants_job_answers_404_on_every_route(tenants, method, path, body):
    server, keys, jobs = tenants["server"], tenants["keys"], tenants["jobs"]
    for tenant, other in (("alpha", "beta"), ("beta", "alpha")):
        job_id = jobs[other]["id"]
        payload = json.loads(json.dumps(body).replace("{id}", job_id)) if body else None
        answer = HTTP.request(
            method, f"{server.url}{path.format(id=job_id)}", headers=server.headers(keys[tenant]), json=payload
        )
        assert answer.status_code == 404, (tenant, answer.text)
        unknown = HTTP.request(
            method,
            f"{server.url}{path.format(id='job-000000000000')}",
            headers=server.headers(keys[tenant]),
            json=json.loads(json.dumps(body).replace("{id}", "job-000000000000")) if body else None,
        )
        assert (
            unknown.status_code == 404
            and unknown.json()["detail"].replace("job-000000000000", job_id) == answer.json()["detail"]
        )


def _probe_reports(server, key: str, job_id: str) -> list[dict]:
    """What the probe env printed, per process that built it (the env check's sandbox prints to no log; the job's
    attempts do), read from the job's log."""
    lines = HTTP.get(f"{server.url}/v1/jobs/{job_id}/logs", headers=server.headers(key)).text.splitlines()
    reports: list[dict] = []
    for line in lines:
        message = json.loads(line)["message"]
        if "PROBE " not in message and "PROBE-ENV " not in message:
            continue
        kind, name, value = message.split("job: ", 1)[1].split(" ", 2)
        if kind == "PROBE" and name == TARGET_FIRST:
            reports.append({"environ": {}})
        if kind == "PROBE-ENV":
            reports[-1]["environ"][name] = value
        else:
            reports[-1][name] = json.loads(value)
    return reports


TARGET_FIRST = "key_store"
ESCAPE = f"opentinker-escape-{os.getpid()}"
"""The file the probe env writes wherever it can: none may appear on the host."""


def test_a_hostile_env_reaches_nothing_of_the_server_or_the_other_tenant(tenants):
    server, keys, jobs = tenants["server"], tenants["keys"], tenants["jobs"]
    reports = _probe_reports(server, keys["beta"], jobs["beta"]["id"])
    assert reports, "the env ran inside the job and printed its report into the job's log"
    for report in reports:
        for target in ("key_store", "worker_key", "server_dir", "data_dir", "alpha_store", "alpha_dir", "etc_shadow"):
            assert report[target] in ("FileNotFoundError", "PermissionError"), (target, report[target])
        # /root holds nothing but the path to the interpreter's installation when Python lives there (pyenv)
        interpreter = Path(sys.base_prefix)
        allowed = {f"listed:{interpreter.parts[2]}"} if interpreter.parts[1:2] == ("root",) else set()
        assert report["root_home"] in {"FileNotFoundError", *allowed}, report["root_home"]
        environ = report["environ"]
        assert environ and CANARY not in json.dumps(environ) and "OPENTINKER_TEST_CANARY" not in environ
        assert not any(key.startswith(("PREFECT_", "OPENTINKER_MLFLOW", "OPENTINKER_SERVER")) for key in environ)
        assert "OPENTINKER_JOB_TOKEN" not in environ and not any("tml-" in value for value in environ.values())
        assert all(CANARY not in text for text in report["proc_environs"])
        # No network at all: the server's API and Prefect are out of reach, directly and on the old proxy's port...
        assert report["server_api"] == "URLError" and report["prefect_direct"] == "URLError", report
        assert report["prefect_loopback"] == "URLError" and report["sockets"] == []
        # ...what it writes outside its scratch stays in its own private tmpfs (nothing reached the host), and no
        # link can be planted where the server writes (its tenant's folder does not exist in there).
        leaked = [folder for folder in report["written"] if (Path(folder) / ESCAPE).exists()]
        assert leaked == [], leaked
        assert report["link"] == "FileNotFoundError"
    assert all(report["poisoned"] == "/job/mlflow.db" for report in reports)  # only its own scratch
    uploads = server.data_dir / "tenants" / "beta" / "uploads"
    assert uploads.is_dir() and not uploads.is_symlink()
    # Trusted code wrote the job's store from what crossed the channel; the job itself never saw it.
    assert (server.data_dir / "tenants" / "beta" / "mlflow.db").exists()


def test_the_other_tenants_key_reads_none_of_its_models_logs_or_artifacts(tenants):
    server, keys, jobs = tenants["server"], tenants["keys"], tenants["jobs"]
    alpha_logs = HTTP.get(f"{server.url}/v1/jobs/{jobs['alpha']['id']}/logs", headers=server.headers(keys["alpha"]))
    assert alpha_logs.status_code == 200 and "Finished in state Completed" in alpha_logs.text
    policy = HTTP.get(f"{server.url}/v1/jobs/{jobs['alpha']['id']}/policy", headers=server.headers(keys["alpha"]))
    with tarfile.open(fileobj=io.BytesIO(policy.content)) as archive:
        assert {"policy.json", "weights.npz"} <= set(archive.getnames())
    for path in ("/v1/services", "/v1/jobs"):
        listed = HTTP.get(f"{server.url}{path}", headers=server.headers(keys["beta"])).json()
        assert jobs["alpha"]["id"] not in json.dumps(listed)


def test_over_quota_submits_answer_429_naming_the_limit(job_server):
    server = job_server
    key = server.make_key("quota")
    admin = server.headers(server.admin_key)
    assert (
        HTTP.patch(
            f"{server.url}/v1/tenants/quota",
            headers=admin,
            json={"max_steps_per_job": 1000, "max_gpus": 0, "max_queued_jobs": 1, "max_running_jobs": 0},
        ).status_code
        == 200
    )
    cases = [
        ({"env_id": "CartPole-v1", "steps": 5000}, "max_steps_per_job"),
        ({"env_id": "CartPole-v1", "steps": 500, "num_gpus": 1}, "max_gpus"),
    ]
    for spec, limit in cases:
        answer = HTTP.post(f"{server.url}/v1/jobs", headers=server.headers(key), json={"spec": spec})
        assert answer.status_code == 429 and limit in answer.json()["detail"], answer.text
        assert int(answer.headers["retry-after"]) > 0
    first = HTTP.post(
        f"{server.url}/v1/jobs", headers=server.headers(key), json={"spec": {"env_id": "CartPole-v1", "steps": 500}}
    )
    assert first.status_code == 201, first.text
    second = HTTP.post(
        f"{server.url}/v1/jobs", headers=server.headers(key), json={"spec": {"env_id": "CartPole-v1", "steps": 500}}
    )
    assert second.status_code == 429 and "max_queued_jobs" in second.json()["detail"]
    # A tenant whose running slots are taken (here: none allowed) sees its job queued, with the reason.
    status = HTTP.get(f"{server.url}/v1/jobs/{first.json()['id']}", headers=server.headers(key)).json()
    assert status["state"] == "QUEUED" and status["queue"]["position"] == 1
    assert "max_running_jobs" in status["queue"]["waiting_for"]
    assert (
        HTTP.post(f"{server.url}/v1/jobs/{first.json()['id']}/cancel", headers=server.headers(key)).status_code == 200
    )
    wait_for_job(server, key, first.json()["id"], lambda s: s["state"] == "CANCELLED", timeout=30)


def test_priorities_order_the_tenants_queue_and_idempotency_makes_one_job(job_server):
    server = job_server
    key = server.make_key("queue")
    admin = server.headers(server.admin_key)
    HTTP.patch(f"{server.url}/v1/tenants/queue", headers=admin, json={"max_running_jobs": 0})
    made = {}
    for name, priority in (("low", 0), ("high", 5), ("mid", 2)):
        body = {"spec": {"env_id": "CartPole-v1", "steps": 500}, "priority": priority, "idempotency_key": f"k-{name}"}
        made[name] = HTTP.post(f"{server.url}/v1/jobs", headers=server.headers(key), json=body).json()
    again = HTTP.post(
        f"{server.url}/v1/jobs",
        headers=server.headers(key),
        json={"spec": {"env_id": "CartPole-v1", "steps": 500}, "priority": 0, "idempotency_key": "k-low"},
    )
    assert again.status_code == 200 and again.json()["id"] == made["low"]["id"]
    listed = HTTP.get(f"{server.url}/v1/jobs", headers=server.headers(key)).json()
    assert len(listed) == 3
    positions = {
        name: HTTP.get(f"{server.url}/v1/jobs/{job['id']}", headers=server.headers(key)).json()["queue"]["position"]
        for name, job in made.items()
    }
    assert positions == {"high": 1, "mid": 2, "low": 3}
    for job in made.values():
        HTTP.post(f"{server.url}/v1/jobs/{job['id']}/cancel", headers=server.headers(key))


def test_every_gymnasium_namespace_is_accepted_at_submit(job_server):
    """Ids are checked against the registry the jobs build from: Atari's ids exist only once ale-py registered them."""
    server = job_server
    key = server.make_key("arcade")
    admin = server.headers(server.admin_key)
    HTTP.patch(f"{server.url}/v1/tenants/arcade", headers=admin, json={"max_running_jobs": 0})
    for env_id in ("ALE/Breakout-v5", "HalfCheetah-v5", "FrozenLake-v1"):
        answer = HTTP.post(f"{server.url}/v1/jobs", headers=server.headers(key), json={"spec": {"env_id": env_id}})
        assert answer.status_code == 201 and answer.json()["state"] == "QUEUED", answer.text
        HTTP.post(f"{server.url}/v1/jobs/{answer.json()['id']}/cancel", headers=server.headers(key))


def _zip_with_link() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        info = zipfile.ZipInfo("pkg/link")
        info.external_attr = 0o120777 << 16
        archive.writestr(info, "/etc/passwd")
    return buffer.getvalue()


BAD_SUBMITS = [
    ("unknown algorithm", {"spec": {"env_id": "CartPole-v1", "algorithm": "a2c"}}, 422, "algorithm: expected one of"),
    ("wrong field", {"spec": {"env_id": "CartPole-v1", "learning_rat": 0.1}}, 422, "learning_rat: unknown field"),
    ("engine field", {"spec": {"env_id": "CartPole-v1", "ppo": {"n_stepz": 3}}}, 422, "n_stepz"),
    ("bad value", {"spec": {"env_id": "CartPole-v1", "steps": -5}}, 422, "steps"),
    (
        "server's field",
        {"spec": {"env_id": "CartPole-v1", "run_name": "mine"}},
        422,
        "spec.run_name: set by the server",
    ),
    (
        "unknown env",
        {"spec": {"env_id": "NoSuchEnv-v9"}},
        422,
        "env_id: 'NoSuchEnv-v9' is not a registered gymnasium id",
    ),
    (
        "retired env version",
        {"spec": {"env_id": "Taxi-v3"}},
        422,
        "Please use `Taxi-v4` instead",
    ),
    (
        "own env, no upload",
        {"spec": {"env_id": "mine.envs:Env"}},
        422,
        "upload_id: env_id 'mine.envs:Env' is your own code",
    ),
    ("unknown upload", {"spec": {"env_id": "mine.envs:Env"}, "upload_id": "upl-nope"}, 422, "upload_id: no upload"),
    ("top-level field", {"spec": {"env_id": "CartPole-v1"}, "colour": "red"}, 422, "colour: unknown field"),
    ("priority", {"spec": {"env_id": "CartPole-v1"}, "priority": 11}, 422, "priority"),
]


@pytest.mark.parametrize(("case", "body", "status", "message"), BAD_SUBMITS, ids=[c[0] for c in BAD_SUBMITS])
def test_bad_submissions_answer_4xx_naming_the_field_and_create_nothing(job_server, case, body, status, message):
    server = job_server
    key = server.make_key("careless")
    answer = HTTP.post(f"{server.url}/v1/jobs", headers=server.headers(key), json=body)
    assert answer.status_code == status and message in answer.json()["detail"], answer.text
    assert "\n" not in answer.json()["detail"]
    assert HTTP.get(f"{server.url}/v1/jobs", headers=server.headers(key)).json() == []


BAD_UPLOADS = [
    ("dotdot", "pkg.tar.gz", lambda: _tar({"pkg/__init__.py": b"", "../escape.py": b"x"}), 422, "outside the archive"),
    ("absolute", "pkg.tar.gz", lambda: _tar({"/tmp/abs.py": b"x"}), 422, "outside the archive"),
    ("symlink", "pkg.tar.gz", lambda: _tar({"pkg/__init__.py": b""}, {"pkg/secret": "/etc/passwd"}), 422, "is a link"),
    ("zip link", "pkg.zip", _zip_with_link, 422, "is a link"),
    ("not an archive", "pkg.tar.gz", lambda: b"plain text", 422, "not a readable archive"),
    ("wrong suffix", "pkg.rar", lambda: b"x", 422, "filename: expected an archive"),
    ("oversized", "pkg.tar.gz", lambda: b"x" * (3 << 20), 413, "at most"),
]


@pytest.mark.parametrize(
    ("case", "filename", "make", "status", "message"), BAD_UPLOADS, ids=[c[0] for c in BAD_UPLOADS]
)
def test_bad_uploads_are_refused_and_leave_nothing(job_server, case, filename, make, status, message):
    import urllib.error
    import urllib.request

    server = job_server
    key = server.make_key("uploader")
    request = urllib.request.Request(  # urllib sends the whole body before reading: a 413 must still be readable
        f"{server.url}/v1/uploads?filename={filename}",
        data=make(),
        headers={**server.headers(key), "Content-Type": "application/octet-stream"},
    )
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(request, timeout=60)
    assert answer.value.code == status
    assert message in json.loads(answer.value.read())["detail"]
    uploads = server.data_dir / "tenants" / "uploader" / "uploads"
    assert not uploads.exists() or not any(uploads.iterdir())
    assert not (server.data_dir / "tenants" / "escape.py").exists()


def test_an_env_that_fails_validate_env_is_refused_at_submit(job_server, tmp_path):
    from opentinker.server.client import Client, ServerError

    server = job_server
    key = server.make_key("broken")
    _package(
        tmp_path,
        "broken_env",
        {
            "envs.py": """
            import gymnasium as gym
            import numpy as np

            class NoSpaces(gym.Env):
                def reset(self, *, seed=None, options=None):
                    return np.zeros(3), {}

                def step(self, action):
                    return np.zeros(3), 0.0, True, False, {}
            """
        },
    )
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ServerError) as refused:
            Client(server.url, key).submit({"env_id": "broken_env.envs:NoSpaces", "steps": 500})
    finally:
        sys.path.remove(str(tmp_path))
    assert refused.value.status == 422
    assert refused.value.detail.startswith("env_id: 'broken_env.envs:NoSpaces'")
    assert HTTP.get(f"{server.url}/v1/jobs", headers=server.headers(key)).json() == []


def test_no_key_and_a_bad_key_answer_401_on_job_routes(job_server):
    server = job_server
    for headers in ({}, {"Authorization": "Bearer tml-000000000000_nope"}, {"X-API-Key": "nope"}):
        assert HTTP.post(f"{server.url}/v1/jobs", headers=headers, json={"spec": {}}).status_code == 401
        assert HTTP.get(f"{server.url}/v1/jobs", headers=headers).status_code == 401
        assert HTTP.post(f"{server.url}/v1/uploads?filename=a.tar.gz", headers=headers, content=b"x").status_code == 401


def test_a_group_job_reports_one_model_per_kind_through_the_same_path(job_server):
    """A multi-agent group is a job like any other: its sandboxed child trains and evaluates every kind, the trusted
    side registers one model per kind from the validated exports, and the job's result names them."""
    from opentinker.cli.client import outcome_lines

    key = job_server.make_key("herd")
    spec = {
        "env_id": "pursuit",
        "algorithm": "group",
        "env_kwargs": {"n_predators": 2, "n_prey": 3, "grid_size": 6, "max_cycles": 12},
        "configs": {"prey": {"learning_starts": 64, "buffer_size": 512, "batch_size": 32, "train_frequency": 8}},
        "steps": 128,
        "num_envs": 2,
        "n_steps": 16,
        "eval_episodes": 2,
    }
    answer = HTTP.post(f"{job_server.url}/v1/jobs", headers=job_server.headers(key), json={"spec": spec})
    assert answer.status_code == 201, answer.text
    job = wait_for_job(job_server, key, answer.json()["id"], lambda s: s["state"] in FINAL)
    assert job["state"] == "SUCCEEDED", job
    result = HTTP.get(f"{job_server.url}/v1/jobs/{job['id']}/result", headers=job_server.headers(key)).json()
    assert result["kind"] == "group" and set(result["kinds"]) == {"predator", "prey"}
    for kind, model in result["kinds"].items():
        assert model["model_name"] == f"{result['model_name']}-{kind}" and model["model_version"] == "1"
        assert isinstance(model["eval_mean"], float)
    assert "predator" in "\n".join(outcome_lines(result))  # the CLI prints it (no eval_mean of its own)
    policy = HTTP.get(f"{job_server.url}/v1/jobs/{job['id']}/policy", headers=job_server.headers(key))
    assert policy.status_code == 409 and "one model per agent kind" in policy.json()["detail"]


def _policy(server, key: str, job_id: str) -> tuple[dict, dict[str, np.ndarray]]:
    archive = HTTP.get(f"{server.url}/v1/jobs/{job_id}/policy", headers=server.headers(key))
    assert archive.status_code == 200, archive.text
    with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
        spec = json.loads(tar.extractfile("policy.json").read())
        data = tar.extractfile("weights.npz").read()
    with np.load(io.BytesIO(data)) as weights:
        return spec, {name: weights[name] for name in weights.files}


def test_the_attacked_tenants_model_ends_exactly_as_without_the_attacker(tenants):
    """Alpha trained beside the hostile job; gamma the same spec alone: the same weights, byte for byte. And each
    tenant's policy route hands back its own model (the poisoned store in beta's scratch reached nothing)."""
    server, keys, jobs = tenants["server"], tenants["keys"], tenants["jobs"]
    alpha_spec, alpha = _policy(server, keys["alpha"], jobs["alpha"]["id"])
    _, alone = _policy(server, keys["gamma"], jobs["gamma"]["id"])
    assert alpha.keys() == alone.keys() and all(np.array_equal(alpha[name], alone[name]) for name in alpha)
    beta_spec, _ = _policy(server, keys["beta"], jobs["beta"]["id"])
    assert alpha_spec["env_id"] == "CartPole-v1" and beta_spec["env_id"] == "probe_env.envs:Probe"
    assert beta_spec["metadata"]["run_id"] != alpha_spec["metadata"]["run_id"]
