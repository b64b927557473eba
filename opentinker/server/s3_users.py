"""Each tenant's own S3 identity, permitted on the tenant's prefix only, on a configured S3 server.

With ``s3_endpoint_url`` and the operator's admin identity (``s3_admin_access_key`` / ``s3_admin_secret_key``), the
server, trusted, acts as S3's admin for one thing, through the IAM API (SeaweedFS serves it on its S3 port; only
admin identities may act on other users): it makes the user ``tenant-<t>``, that user's key pair and its one inline
policy — get, put and delete objects under ``<bucket>/tenants/<t>/`` and list the bucket under that prefix; no other
prefix, no bucket operation, no other user. SeaweedFS lets every identity manage its own access keys, whatever its
policy: ``ensure`` deletes any pair the tenant minted, and restores the derived one, at every launch. The pair is
derived from ``s3_tenant_secret`` (HMAC of the tenant's name, as the tenant's MLflow password is), so nothing is
stored and every server process derives the same one: SeaweedFS's ``CreateAccessKey`` takes the pair to create
(AWS's generates one; there the generated pair would have to be stored).

A job attempt and its sandboxed child get the tenant's pair from the launch (``tenant_env``), never the operator's;
S3 answers AccessDenied to anything outside the tenant's prefix. The admin pair stays in the API processes' settings
and is used for these calls only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from dataclasses import dataclass

from opentinker.infra.settings import Settings

from . import tenants

USER_PREFIX = "tenant-"
POLICY_NAME = "opentinker-tenant"


class S3IdentityError(RuntimeError):
    """The S3 server refused the admin's call, or is not reachable; the message names the call."""


@dataclass(frozen=True)
class S3Credentials:
    access_key: str
    secret_key: str


def enabled(settings: Settings) -> bool:
    """Whether tenants get S3 identities: an S3 server and the admin identity are configured."""
    return bool(settings.s3_endpoint_url and settings.s3_admin_access_key)


def username(tenant: str) -> str:
    return f"{USER_PREFIX}{tenants.check_name(tenant)}"


def credentials(tenant: str, settings: Settings) -> S3Credentials:
    """The tenant's key pair (derived, never stored): a 20-character id and a 40-character secret, alphanumeric as
    IAM's are, from two HMAC-SHA256s of the tenant's name."""
    secret = settings.s3_tenant_secret or settings.s3_admin_secret_key
    if not secret:
        raise S3IdentityError("s3_tenant_secret: set a secret to derive the tenants' S3 key pairs from")

    def derive(label: str) -> str:
        return hmac.new(secret.encode(), f"opentinker-s3-{label}:{tenant}".encode(), hashlib.sha256).hexdigest()

    return S3Credentials("OT" + derive("access-key")[:18].upper(), derive("secret-key")[:40])


def policy(tenant: str, bucket: str) -> dict:
    """The tenant's one inline policy: objects under its prefix, and listing only that prefix."""
    prefix = tenants.s3_prefix(tenant)
    objects = ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"]
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Action": objects, "Resource": [f"arn:aws:s3:::{bucket}/{prefix}*"]},
            {
                "Effect": "Allow",
                "Action": ["s3:ListBucket"],
                "Resource": [f"arn:aws:s3:::{bucket}"],
                "Condition": {"StringLike": {"s3:prefix": [f"{prefix}*"]}},
            },
        ],
    }


def tenant_env(tenant: str, settings: Settings) -> dict[str, str]:
    """The S3 variables of a process acting for ``tenant`` alone (an attempt, its sandboxed child): the endpoint, the
    tenant's own pair (its identity made first) and its prefix; empty unless tenants get identities."""
    if not enabled(settings):
        return {}
    creds = identities(settings).ensure(tenant)
    return {
        "OPENTINKER_S3_ENDPOINT_URL": settings.s3_endpoint_url,
        "OPENTINKER_S3_BUCKET": settings.s3_bucket,
        "OPENTINKER_S3_REGION": settings.s3_region,
        "OPENTINKER_S3_ACCESS_KEY": creds.access_key,
        "OPENTINKER_S3_SECRET_KEY": creds.secret_key,
        "OPENTINKER_S3_PREFIX": tenants.s3_prefix(tenant),
    }


class TenantS3Identities:
    """The admin side: tenants' users, key pairs and policies, made once per process."""

    def __init__(self, settings: Settings):
        import boto3

        self.settings = settings
        self.iam = boto3.client(
            "iam",
            endpoint_url=settings.s3_endpoint_url,
            aws_access_key_id=settings.s3_admin_access_key,
            aws_secret_access_key=settings.s3_admin_secret_key,
            region_name=settings.s3_region,
        )
        self._lock = threading.Lock()
        self._ready: set[str] = set()

    def ensure(self, tenant: str) -> S3Credentials:
        """The tenant's user with the derived pair as its only key and the prefix policy as its only grant. The keys
        are reconciled on every call (each launch): SeaweedFS lets any identity create, delete and deactivate its
        own keys (self-service, hard-coded in its IAM authoriser; its policies take only ``Allow``), so a pair a job
        minted is deleted here and a derived one it deleted or deactivated is made again."""
        creds = credentials(tenant, self.settings)
        user = username(tenant)
        with self._lock:
            if tenant not in self._ready:
                self._call(self.iam.create_user, UserName=user)
                document = json.dumps(policy(tenant, self.settings.s3_bucket))
                self._call(self.iam.put_user_policy, UserName=user, PolicyName=POLICY_NAME, PolicyDocument=document)
            keys = self._keys(user)
            if keys.get(creds.access_key) != "Active":
                if creds.access_key in keys:
                    self._call(self.iam.delete_access_key, UserName=user, AccessKeyId=creds.access_key)
                self._create_key(user, creds)
                keys = self._keys(user)
                if creds.access_key not in keys:
                    raise S3IdentityError(f"S3 user {user} does not hold its derived key {creds.access_key}")
            for key in keys:  # minted by the tenant, or derived under an earlier secret: opens nothing from now on
                if key != creds.access_key:
                    self._call(self.iam.delete_access_key, UserName=user, AccessKeyId=key)
            self._ready.add(tenant)
        return creds

    def _keys(self, user: str) -> dict[str, str]:
        """The user's access key ids and their status."""
        listed = self._call(self.iam.list_access_keys, UserName=user)["AccessKeyMetadata"]
        return {key["AccessKeyId"]: key.get("Status", "Active") for key in listed}

    def _create_key(self, user: str, creds: S3Credentials) -> None:
        """``CreateAccessKey`` with the pair to create in its body (SeaweedFS reads ``AccessKeyId`` and
        ``SecretAccessKey`` there; boto3's model has no such parameters, so they are added to the request)."""

        def chosen(params: dict, **_) -> None:
            params["body"].update(AccessKeyId=creds.access_key, SecretAccessKey=creds.secret_key)

        event = "before-call.iam.CreateAccessKey"
        self.iam.meta.events.register(event, chosen, unique_id="opentinker-chosen-pair")
        try:
            self._call(self.iam.create_access_key, UserName=user)
        finally:
            self.iam.meta.events.unregister(event, unique_id="opentinker-chosen-pair")

    def _call(self, method, **kwargs) -> dict:
        """One IAM call; an entity that already exists (made by this or another server process) is no error."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return method(**kwargs)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "EntityAlreadyExists":
                return {}
            raise S3IdentityError(f"S3 server {self.settings.s3_endpoint_url}: IAM {method.__name__}: {exc}") from exc
        except BotoCoreError as exc:
            raise S3IdentityError(f"S3 server {self.settings.s3_endpoint_url}: IAM {method.__name__}: {exc}") from exc


_identities: dict[tuple[str, str], TenantS3Identities] = {}
_identities_lock = threading.Lock()


def identities(settings: Settings) -> TenantS3Identities:
    """One ``TenantS3Identities`` per S3 server and admin in this process (what it made is remembered)."""
    key = (settings.s3_endpoint_url, settings.s3_admin_access_key)
    with _identities_lock:
        if key not in _identities:
            _identities[key] = TenantS3Identities(settings)
        return _identities[key]
