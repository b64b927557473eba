"""train_flow against the local stack: the real MLflow server (artifacts proxied to SeaweedFS S3), listed with boto3."""

from __future__ import annotations

import mlflow
import pytest
from fixtures.pipeline import RUN_ARTIFACTS, settings_env, small_train_params

pytestmark = pytest.mark.slow


def _stack_env(s3_server, mlflow_server: str, **extra: str) -> dict[str, str]:
    return {
        "OPENTINKER_MLFLOW_TRACKING_URI": mlflow_server,
        "OPENTINKER_S3_ENDPOINT_URL": s3_server.endpoint_url,
        "OPENTINKER_S3_ACCESS_KEY": s3_server.access_key,
        "OPENTINKER_S3_SECRET_KEY": s3_server.secret_key,
        "OPENTINKER_S3_BUCKET": s3_server.bucket,
        **extra,
    }


def test_train_flow_on_the_stack_puts_artifacts_in_s3(s3_server, mlflow_server):
    from opentinker.flows.train import train_flow
    from opentinker.infra.s3 import s3_client

    params = small_train_params(
        steps=2048, run_name="stack-run", model_name="stack-cartpole", experiment="stack-test", eval_episodes=2
    )
    with settings_env(**_stack_env(s3_server, mlflow_server)):
        result = train_flow(params)
        client = mlflow.MlflowClient(mlflow_server)
        assert client.get_run(result.run_id).data.metrics["charts/sps"] > 0
        assert str(client.get_model_version_by_alias("stack-cartpole", "champion").version) == result.model_version
        listed = s3_client().list_objects_v2(Bucket=s3_server.bucket)
    keys = {item["Key"] for item in listed.get("Contents", [])}
    run_keys = {key.split(f"{result.run_id}/artifacts/", 1)[1] for key in keys if f"{result.run_id}/artifacts/" in key}
    assert RUN_ARTIFACTS <= run_keys, sorted(keys)
    assert f"checkpoints/{params.resolved_run_name}/checkpoint.pt" in keys
    assert any("policy.json" in key for key in keys)  # the logged MLflow model's export dir


def test_wrong_s3_credentials_fail_fast_and_register_nothing(s3_server, mlflow_server):
    from opentinker.flows.train import train_flow
    from opentinker.infra.s3 import S3Error

    params = small_train_params(
        steps=512, run_name="bad-creds", model_name="bad-creds-cartpole", experiment="stack-test"
    )
    with settings_env(**_stack_env(s3_server, mlflow_server, OPENTINKER_S3_SECRET_KEY="wrong-secret")):
        with pytest.raises(S3Error, match="rejected the credentials"):
            train_flow(params)
    client = mlflow.MlflowClient(mlflow_server)
    assert client.search_registered_models(filter_string="name='bad-creds-cartpole'") == []
    experiment = client.get_experiment_by_name("stack-test")
    if experiment is not None:
        assert client.search_runs([experiment.experiment_id], filter_string="tags.`mlflow.runName` = 'bad-creds'") == []
