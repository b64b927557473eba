"""The one place that builds S3 clients: endpoint, credentials and region come from the settings."""

from __future__ import annotations

from opentinker.infra.settings import Settings, get_settings


class S3Error(RuntimeError):
    """S3 is unreachable, refuses the credentials, or the bucket cannot be used; the message says which."""


def s3_client(settings: Settings | None = None):
    """A boto3 S3 client for the configured endpoint (path-style addressing, short timeouts, few retries)."""
    import boto3
    from botocore.config import Config

    settings = settings or get_settings()
    config = Config(
        s3={"addressing_style": "path"},
        connect_timeout=5,
        read_timeout=60,
        retries={"max_attempts": 3, "mode": "standard"},
        signature_version="s3v4",
    )
    return boto3.client(
        "s3",
        endpoint_url=settings.s3_endpoint_url or None,
        aws_access_key_id=settings.s3_access_key or None,
        aws_secret_access_key=settings.s3_secret_key or None,
        region_name=settings.s3_region,
        config=config,
    )


def ensure_bucket(bucket: str | None = None, settings: Settings | None = None, client=None) -> str:
    """Create ``bucket`` (default: ``settings.s3_bucket``) unless it exists; returns its name.

    Raises ``S3Error`` naming the endpoint when it cannot be reached or rejects the credentials.
    """
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    settings = settings or get_settings()
    bucket = bucket or settings.s3_bucket
    client = client or s3_client(settings)
    endpoint = settings.s3_endpoint_url or "AWS S3"
    try:
        client.head_bucket(Bucket=bucket)
        return bucket
    except EndpointConnectionError as exc:
        raise S3Error(
            f"S3 endpoint {endpoint} is not reachable (s3_endpoint_url / OPENTINKER_S3_ENDPOINT_URL); "
            f"is the stack up? `opentinker stack status`. ({exc})"
        ) from exc
    except NoCredentialsError as exc:
        raise S3Error("No S3 credentials: set OPENTINKER_S3_ACCESS_KEY and OPENTINKER_S3_SECRET_KEY.") from exc
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in {"403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied"} or status == 403:
            raise S3Error(
                f"S3 endpoint {endpoint} rejected the credentials for bucket {bucket!r} "
                f"(OPENTINKER_S3_ACCESS_KEY / OPENTINKER_S3_SECRET_KEY): {code or status}"
            ) from exc
        if code not in {"404", "NoSuchBucket", "NotFound"}:
            raise S3Error(f"S3 endpoint {endpoint}: cannot use bucket {bucket!r}: {code or status} {exc}") from exc
    try:
        client.create_bucket(Bucket=bucket)
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code not in {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}:
            raise S3Error(f"S3 endpoint {endpoint}: could not create bucket {bucket!r}: {code} {exc}") from exc
    return bucket
