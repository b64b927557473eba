"""S3 client and SeaweedFS: real put/get, and clear errors for a dead endpoint or wrong credentials."""

from __future__ import annotations

import os
import uuid

import pytest

from opentinker.infra.processes import free_ports
from opentinker.infra.s3 import S3Error, ensure_bucket, s3_client
from opentinker.infra.settings import Settings

pytestmark = pytest.mark.slow  # starts real services or trains through a flow


def test_put_get_and_list_round_trip(s3_server):
    client = s3_client(s3_server.settings())
    key = f"roundtrip/{uuid.uuid4().hex}.bin"
    payload = os.urandom(300_000)
    client.put_object(Bucket=s3_server.bucket, Key=key, Body=payload)
    assert client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read() == payload
    keys = [obj["Key"] for obj in client.list_objects_v2(Bucket=s3_server.bucket, Prefix="roundtrip/")["Contents"]]
    assert key in keys


def test_ensure_bucket_creates_once_and_is_idempotent(s3_server):
    settings = s3_server.settings()
    name = f"fresh-{uuid.uuid4().hex[:12]}"
    client = s3_client(settings)
    assert name not in {b["Name"] for b in client.list_buckets()["Buckets"]}
    assert ensure_bucket(name, settings=settings) == name
    assert ensure_bucket(name, settings=settings) == name
    assert name in {b["Name"] for b in client.list_buckets()["Buckets"]}


def test_wrong_credentials_are_named_in_the_error(s3_server):
    settings = Settings(
        s3_endpoint_url=s3_server.endpoint_url,
        s3_access_key=s3_server.access_key,
        s3_secret_key="not-the-secret",
        s3_bucket=s3_server.bucket,
    )
    with pytest.raises(S3Error, match="rejected the credentials"):
        ensure_bucket(settings=settings)
    unknown_key = Settings(
        s3_endpoint_url=s3_server.endpoint_url, s3_access_key="nobody", s3_secret_key="x", s3_bucket=s3_server.bucket
    )
    with pytest.raises(S3Error, match="OPENTINKER_S3_ACCESS_KEY"):
        ensure_bucket(settings=unknown_key)


def test_dead_endpoint_says_it_is_not_reachable():
    (port,) = free_ports(1)  # nothing listens here
    settings = Settings(s3_endpoint_url=f"http://127.0.0.1:{port}", s3_access_key="a", s3_secret_key="b")
    with pytest.raises(S3Error, match=rf"127\.0\.0\.1:{port} is not reachable"):
        ensure_bucket(settings=settings)


def test_mlflow_server_proxies_artifacts_to_s3(mlflow_server, s3_server, tmp_path):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=mlflow_server)
    experiment_id = client.create_experiment(f"proxy-{uuid.uuid4().hex[:8]}")
    run = client.create_run(experiment_id)
    artifact = tmp_path / "note.txt"
    artifact.write_text("stored in seaweedfs")
    client.log_artifact(run.info.run_id, str(artifact))
    client.set_terminated(run.info.run_id)

    objects = s3_client(s3_server.settings()).list_objects_v2(Bucket=s3_server.bucket, Prefix="mlflow/")["Contents"]
    keys = [obj["Key"] for obj in objects]
    assert any(
        key.startswith(f"mlflow/{experiment_id}/{run.info.run_id}/") and key.endswith("note.txt") for key in keys
    )
    downloaded = client.download_artifacts(run.info.run_id, "note.txt", str(tmp_path / "back"))
    assert open(downloaded).read() == "stored in seaweedfs"
