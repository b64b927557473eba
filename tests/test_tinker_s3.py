"""The Tinker engine on the embedded stack with S3 configured (the operator's pair, the admin that makes tenants'
identities, and boto3's own variables all in the server's environment): the engine's process, and every process of
the Ray it runs on, holds none of those keys, neither in its environment nor in its settings, and a tenant's run
still records its metrics and logs its registered adapter, into the tenant's own store (artifacts in the tenant's
folder, nothing written to S3). A server of its own on the tiny Llama; SeaweedFS is the session's."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from fixtures.tinker import (
    TINY,
    TinkerServer,
    engine_pid,
    engine_state,
    environments,
    own_tinker_server,
    ray_processes,
)
from tinker import types

pytestmark = pytest.mark.slow

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun."
TENANT = "artist"


@pytest.fixture(scope="module")
def server(tmp_path_factory, s3_server) -> TinkerServer:
    env = {
        "OPENTINKER_S3_ENDPOINT_URL": s3_server.endpoint_url,
        "OPENTINKER_S3_BUCKET": s3_server.bucket,
        "OPENTINKER_S3_REGION": s3_server.region,
        "OPENTINKER_S3_ACCESS_KEY": s3_server.access_key,
        "OPENTINKER_S3_SECRET_KEY": s3_server.secret_key,
        "OPENTINKER_S3_ADMIN_ACCESS_KEY": s3_server.access_key,
        "OPENTINKER_S3_ADMIN_SECRET_KEY": s3_server.secret_key,
        "OPENTINKER_S3_TENANT_SECRET": "tinker-s3-tenant-secret-of-the-tests",
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
    }
    with own_tinker_server(tmp_path_factory.mktemp("tinker-s3"), env) as server:
        yield server


def _holding(environments: list[dict[str, str]], secret: str) -> set[str]:
    """The variables of these environments that hold ``secret``, or are named as the operator's credentials."""
    from opentinker.server.tinker.remote import OPERATOR_VARIABLES

    return {k for env in environments for k, v in env.items() if v == secret or k in OPERATOR_VARIABLES}


def test_the_engine_holds_no_operator_s3_key_and_a_tenants_run_logs_its_artifacts(server, s3_server, tmp_path):
    import boto3
    import mlflow
    from botocore.config import Config

    from opentinker.agents.lm_policy import ADAPTER_META
    from opentinker.infra.settings import Settings
    from opentinker.server import tenants
    from opentinker.server.tinker.remote import OPERATOR_SETTINGS

    secret = s3_server.secret_key
    api = environments([psutil.Process(server.handle.service.pid)])
    held_by_api = {"OPENTINKER_S3_SECRET_KEY", "OPENTINKER_S3_ADMIN_SECRET_KEY", "AWS_SECRET_ACCESS_KEY"}
    assert held_by_api <= _holding(api, secret)  # what the API holds

    service = server.service_client(TENANT)
    training = service.create_lora_training_client(base_model=TINY, rank=4, seed=5).result()
    tokens = training.get_tokenizer().encode(TEXT)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": np.ones(len(tokens) - 1, np.float32)},
    )
    for _ in range(2):
        step = training.forward_backward([datum], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert step.result().metrics["loss:sum"] > 0
    path = training.save_weights_for_sampler("final").result().path
    with server.http(TENANT) as http:
        answer = http.post("/api/v1/register_checkpoint", json={"path": path, "model_name": "poet", "alias": "live"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["model_name"] == f"{TENANT}.poet"

    # No process of the engine's Ray (the engine's included) inherited a key; inside the engine, neither its
    # environment now (after an MLflow write to the tenant's experiment) nor its settings hold one.
    processes = ray_processes(server)
    engine = engine_pid(server)
    assert engine in {p.pid for p in processes}, (engine, [(p.pid, p.name()) for p in processes])
    assert _holding(environments(processes), secret) == set()
    settings = Settings(data_dir=server.handle.data_dir)
    held, environ = engine_state(server)
    assert held["s3_endpoint_url"] == s3_server.endpoint_url  # the engine's real settings, less the keys
    assert {name: held[name] for name in OPERATOR_SETTINGS} == dict.fromkeys(OPERATOR_SETTINGS, "")
    assert secret not in {str(value) for value in held.values()}
    assert _holding([environ], secret) == set()

    # The tenant's run has its metrics and its registered adapter, in the tenant's own store and folder.
    client = mlflow.MlflowClient(tracking_uri=server.tracking_uri(TENANT))
    experiment = client.get_experiment_by_name(tenants.experiment(TENANT))
    assert experiment.artifact_location == (tenants.data_dir(TENANT, settings) / "artifacts").as_uri()
    deadline = time.monotonic() + 30
    while not (
        runs := client.search_runs([experiment.experiment_id], f"tags.`tinker.model_id` = '{training.model_id}'")
    ):
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert len(client.get_metric_history(runs[0].info.run_id, "train/loss")) == 2
    version = client.get_model_version_by_alias(f"{TENANT}.poet", "live")
    assert version.run_id == runs[0].info.run_id  # logged into the client's own run
    stored = client.get_model_version_download_uri(f"{TENANT}.poet", version.version)
    assert stored.startswith(experiment.artifact_location)  # in the tenant's folder, not S3
    adapter = mlflow.artifacts.download_artifacts(artifact_uri=stored, dst_path=str(tmp_path))
    assert list(Path(adapter).glob(f"**/{ADAPTER_META}"))
    operator = boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint_url,
        aws_access_key_id=s3_server.access_key,
        aws_secret_access_key=s3_server.secret_key,
        region_name=s3_server.region,
        config=Config(s3={"addressing_style": "path"}),
    )
    listed = operator.list_objects_v2(Bucket=s3_server.bucket, Prefix=tenants.s3_prefix(TENANT))
    assert listed.get("KeyCount", 0) == 0  # nothing of the engine's went to S3
    service.close("success").result()
