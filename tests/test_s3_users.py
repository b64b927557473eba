"""Tenants' S3 identities on a real SeaweedFS (``opentinker.server.s3_users``): each reaches its own prefix and nothing
else — not another tenant's prefix (one whose name starts with its own included), not the operator's objects, not
the bucket's listing, not another user's IAM (its own keys it may manage: the next launch undoes that) — and the
server making them again (another process, a new secret) leaves one pair."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError


def _settings(s3_server, secret: str = "tenant-s3-secret-of-the-tests"):
    from opentinker.infra.settings import Settings

    return Settings(
        s3_endpoint_url=s3_server.endpoint_url,
        s3_bucket=s3_server.bucket,
        s3_region=s3_server.region,
        s3_admin_access_key=s3_server.access_key,
        s3_admin_secret_key=s3_server.secret_key,
        s3_tenant_secret=secret,
    )


def _client(s3_server, creds, service: str = "s3"):
    import boto3
    from botocore.config import Config

    return boto3.client(
        service,
        endpoint_url=s3_server.endpoint_url,
        aws_access_key_id=creds.access_key,
        aws_secret_access_key=creds.secret_key,
        region_name=s3_server.region,
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )


def _refused(call, **kwargs) -> tuple[str, int]:
    """The error code and HTTP status the server answered ``call`` with (it must refuse it)."""
    with pytest.raises(ClientError) as refused:
        call(**kwargs)
    answer = refused.value.response
    return answer.get("Error", {}).get("Code", ""), answer["ResponseMetadata"]["HTTPStatusCode"]


def test_a_tenants_identity_reads_writes_and_lists_its_own_prefix_only(s3_server):
    from opentinker.infra.s3 import s3_client
    from opentinker.server.s3_users import TenantS3Identities, tenant_env

    settings = _settings(s3_server)
    identities = TenantS3Identities(settings)
    # "sa" and "sab": the prefix tenants/sa/ must not reach tenants/sab/
    a, b = identities.ensure("sa"), identities.ensure("sab")
    assert a != b and (a.access_key, a.secret_key) != (s3_server.access_key, s3_server.secret_key)
    bucket = s3_server.bucket
    operator = s3_client(s3_server.settings())
    operator.put_object(Bucket=bucket, Key="mlflow/operator-object", Body=b"operator")
    as_a, as_b = _client(s3_server, a), _client(s3_server, b)
    as_a.put_object(Bucket=bucket, Key="tenants/sa/data/x.txt", Body=b"a's")
    as_b.put_object(Bucket=bucket, Key="tenants/sab/data/y.txt", Body=b"b's")
    assert as_a.get_object(Bucket=bucket, Key="tenants/sa/data/x.txt")["Body"].read() == b"a's"
    listed = as_a.list_objects_v2(Bucket=bucket, Prefix="tenants/sa/")
    assert [item["Key"] for item in listed["Contents"]] == ["tenants/sa/data/x.txt"]

    for call, kwargs in (
        (as_a.get_object, {"Key": "tenants/sab/data/y.txt"}),
        (as_a.put_object, {"Key": "tenants/sab/data/planted", "Body": b"x"}),
        (as_a.delete_object, {"Key": "tenants/sab/data/y.txt"}),
        (as_a.list_objects_v2, {"Prefix": "tenants/sab/"}),
        (as_a.list_objects_v2, {"Prefix": "tenants/"}),
        (as_a.list_objects_v2, {}),
        (as_a.get_object, {"Key": "mlflow/operator-object"}),
        (as_a.put_object, {"Key": "mlflow/planted", "Body": b"x"}),
        (as_b.get_object, {"Key": "tenants/sa/data/x.txt"}),
    ):
        assert _refused(call, Bucket=bucket, **kwargs) == ("AccessDenied", 403), (call, kwargs)
    assert _refused(as_a.create_bucket, Bucket="sa-own-bucket") == ("AccessDenied", 403)
    iam = _client(s3_server, a, "iam")  # no identity management: no other user's keys, no grant of its own
    assert _refused(iam.list_users)[1] == 403
    assert _refused(iam.create_access_key, UserName="tenant-sab")[1] == 403
    grab = '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}'
    assert _refused(iam.put_user_policy, UserName="tenant-sa", PolicyName="grab", PolicyDocument=grab)[1] == 403
    assert _refused(iam.delete_user_policy, UserName="tenant-sa", PolicyName="opentinker-tenant")[1] == 403
    # Its own keys it may manage (SeaweedFS's self-service): what it minted or broke is undone at the next launch.
    minted = iam.create_access_key(UserName="tenant-sa")["AccessKey"]
    iam.update_access_key(UserName="tenant-sa", AccessKeyId=a.access_key, Status="Inactive")
    assert identities.ensure("sa") == a
    stray = type(a)(minted["AccessKeyId"], minted["SecretAccessKey"])
    assert _refused(_client(s3_server, stray).get_object, Bucket=bucket, Key="tenants/sa/data/x.txt")[1] == 403
    assert as_a.get_object(Bucket=bucket, Key="tenants/sa/data/x.txt")["Body"].read() == b"a's"  # restored
    iam.delete_access_key(UserName="tenant-sa", AccessKeyId=a.access_key)
    assert identities.ensure("sa") == a
    assert as_a.get_object(Bucket=bucket, Key="tenants/sa/data/x.txt")["Body"].read() == b"a's"
    # nothing of B's changed, nothing planted
    assert operator.get_object(Bucket=bucket, Key="tenants/sab/data/y.txt")["Body"].read() == b"b's"
    keys = {item["Key"] for item in operator.list_objects_v2(Bucket=bucket)["Contents"]}
    assert not {"tenants/sab/data/planted", "mlflow/planted"} & keys

    # What an attempt and its child get: the endpoint and the tenant's own pair, as the project's settings read them.
    env = tenant_env("sa", settings)
    assert env["OPENTINKER_S3_ACCESS_KEY"] == a.access_key and env["OPENTINKER_S3_SECRET_KEY"] == a.secret_key
    assert s3_server.secret_key not in env.values()


def test_making_the_identity_again_keeps_one_pair_and_a_new_secret_retires_the_old(s3_server):
    from opentinker.server.s3_users import TenantS3Identities, username

    bucket = s3_server.bucket
    first = TenantS3Identities(_settings(s3_server)).ensure("sc")
    again = TenantS3Identities(_settings(s3_server)).ensure("sc")  # another server process: the same pair
    assert again == first
    _client(s3_server, again).put_object(Bucket=bucket, Key="tenants/sc/x", Body=b"c")
    rotated = TenantS3Identities(_settings(s3_server, secret="a-new-secret")).ensure("sc")
    assert rotated != first
    assert _client(s3_server, rotated).get_object(Bucket=bucket, Key="tenants/sc/x")["Body"].read() == b"c"
    assert _refused(_client(s3_server, first).get_object, Bucket=bucket, Key="tenants/sc/x")[1] == 403
    admin = _client(s3_server, type(first)(s3_server.access_key, s3_server.secret_key), "iam")
    held = admin.list_access_keys(UserName=username("sc"))["AccessKeyMetadata"]
    assert [key["AccessKeyId"] for key in held] == [rotated.access_key]
