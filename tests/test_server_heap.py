"""The server freezes the heap it built at start-up: a full garbage collection, which holds the GIL, then walks only
what came after, not the ~0.5 M objects of its modules and app (0.2-0.4 s in which no request was answered, the
status p99 of bench/service.py (c) before the freeze)."""

from __future__ import annotations

import gc
import tarfile
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient
from fixtures.server import process_memory

from opentinker.infra.settings import Settings
from opentinker.server.app import create_app


def test_start_up_leaves_the_collector_a_small_heap(tmp_path):
    gc.unfreeze()
    try:
        with TestClient(create_app(Settings(data_dir=tmp_path), jobs=False)) as client:
            assert client.get("/healthz").status_code == 200
            frozen, walked = gc.get_freeze_count(), len(gc.get_objects())
            assert frozen > 100_000  # the modules and the app, MLflow's store among them
            assert walked < frozen / 4
    finally:
        gc.unfreeze()


def _big_export(directory: Path) -> Path:
    """A legitimate export of ~195 MiB (CartPole, hidden layers (1, 7.3 M): weights within ``MAX_WEIGHTS_BYTES``),
    its weights random (they hardly compress, as trained ones), built in a second without torch's init."""
    import gymnasium as gym
    import numpy as np
    import torch

    from opentinker.agents.export import export_policy
    from opentinker.agents.policies import ActorCritic, policy_spec

    spaces = gym.spaces.Box(-1, 1, (4,), "float32"), gym.spaces.Discrete(2)
    spec = policy_spec(*spaces, False, (1, 7_300_000), "tanh")
    rng = np.random.default_rng(0)
    with torch.device("meta"):  # the real network's shapes, nothing allocated
        shapes = {name: tuple(value.shape) for name, value in ActorCritic(spec).state_dict().items()}
    weights = SimpleNamespace(
        spec=spec,
        observation_space=spaces[0],
        action_space=spaces[1],
        numpy_weights=lambda: {name: rng.random(shape, np.float32) for name, shape in shapes.items()},
    )
    return export_policy(weights, directory)


@pytest.mark.slow
def test_a_large_policy_download_streams_from_disk_with_the_apis_memory_flat(job_server, tmp_path):
    """``GET /v1/jobs/{id}/policy`` of a 195 MiB export: the API's peak RSS grows by less than 50 MiB (it held the
    whole archive before: +176 MiB here)."""
    from opentinker.server import tenants
    from opentinker.server.db import Job, Store
    from opentinker.server.models import prepare_store, tenant_mlflow
    from opentinker.server.schemas import JobResult
    from opentinker.tasks.spec import RunSpec

    server, tenant, name = job_server, "heavy", "heavy.big-policy"
    key = server.make_key(tenant)
    settings = Settings(data_dir=server.data_dir)
    prepare_store(tenant, settings)
    export = _big_export(tmp_path / "export")
    size = (export / "weights.npz").stat().st_size
    assert size > 190 << 20
    with tenant_mlflow(tenant, settings) as mlflow:  # registered straight from its files: the download is the subject
        client = mlflow.MlflowClient()
        experiment = client.get_experiment_by_name(tenants.experiment(tenant)).experiment_id
        run = client.create_run(experiment)
        client.log_artifacts(run.info.run_id, str(export), "policy")
        client.create_registered_model(name)
        client.create_model_version(name, f"runs:/{run.info.run_id}/policy", run.info.run_id)
        client.set_terminated(run.info.run_id)
    result = JobResult(
        run_id=run.info.run_id, experiment_id=experiment, model_name=name, model_version="1", aliases=[], decision=""
    )
    store = Store(server.database)
    try:
        with store.session() as session:  # as the server records a finished job
            spec = RunSpec(env_id="CartPole-v1")
            session.add(Job(id="job-big-policy", tenant=tenant, state="SUCCEEDED", spec=spec, result=result))
    finally:
        store.close()

    pid = server.service.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the RSS now
    before = process_memory(pid)["VmRSS"]
    archive = tmp_path / "policy.tar.gz"
    with httpx.stream(
        "GET", f"{server.url}/v1/jobs/job-big-policy/policy", headers=server.headers(key), timeout=120
    ) as answer:
        assert answer.status_code == 200, answer.read()[:500]
        assert int(answer.headers["content-length"]) > 0
        with archive.open("wb") as handle:
            for chunk in answer.iter_bytes():
                handle.write(chunk)
    grown = process_memory(pid)["VmHWM"] - before
    with tarfile.open(archive) as downloaded:
        assert downloaded.getnames() == ["policy.json", "weights.npz"]
        assert downloaded.getmember("weights.npz").size == size
    assert grown < 50 << 20, f"the API's peak RSS grew by {grown / (1 << 20):.0f} MiB"
