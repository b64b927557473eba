"""Each tenant's own MLflow user on a configured MLflow server with MLflow's authentication app.

With ``mlflow_tracking_uri`` naming a server started as ``mlflow server --app-name basic-auth`` (its
``default_permission = NO_PERMISSIONS``) and the operator's admin credentials in ``mlflow_admin_username`` /
``mlflow_admin_password``, the server, trusted, acts as MLflow's admin for exactly three things, and nothing of a
tenant's data: it creates the MLflow user ``tenant-<t>`` (its password an HMAC of the tenant's name under
``mlflow_tenant_secret``, so no password is stored anywhere and every server process derives the same one), creates
the tenant's experiment ``tenant-<t>`` and every registered model a job of the tenant will register (``<t>.<name>``:
MLflow's permissions are per model name, so each is made and granted before a job needs it), and grants that user
``MANAGE`` on each. Everything else — an attempt writing its run and model, the server reading a result or a policy,
a policy service loading its model, the tenant's browser on the MLflow UI — uses the tenant's own credentials, which
MLflow checks: another tenant's experiment, runs, artifacts and models answer 403.

Without workspaces MLflow lets any user create experiments and registered models, so a tenant holding its dashboard
credentials could create ``tenant-b`` or ``b.policy`` before tenant ``b`` does, and grant ``tenant-b`` on it to read
what b's jobs would write there. The server therefore makes these names itself, and when one already exists it
checks MLflow's own grants (``users/list``, one call): a name on which any user but the tenant's own and the admins
holds a grant is refused (``MlflowIdentityError``, the job fails naming it), never written to. A name checked once
stays the tenant's (only the tenant and admins can grant on it afterwards), so each process checks it once.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote, urlsplit, urlunsplit

import httpx

from opentinker.infra.settings import Settings

from . import tenants

if TYPE_CHECKING:
    from opentinker.tasks.spec import RunSpec

USER_PREFIX = "tenant-"
EXPERIMENT_TAG = ("opentinker.tenant", "")


class MlflowIdentityError(RuntimeError):
    """The MLflow server refused the admin's call, or a tenant's name there belongs to someone else."""


class NameTaken(MlflowIdentityError):
    """A name of the tenant's (its experiment, a model) was made by another MLflow user: no job may write there."""


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str


def enabled(settings: Settings) -> bool:
    """Whether tenants get MLflow users: an MLflow server and its admin credentials are configured."""
    return bool(settings.mlflow_tracking_uri.startswith("http") and settings.mlflow_admin_username)


def username(tenant: str) -> str:
    return f"{USER_PREFIX}{tenants.check_name(tenant)}"


def credentials(tenant: str, settings: Settings) -> Credentials:
    """The tenant's MLflow user and password (derived, never stored: HMAC-SHA256 of the tenant's name)."""
    secret = settings.mlflow_tenant_secret or settings.mlflow_admin_password
    if not secret:
        raise MlflowIdentityError("mlflow_tenant_secret: set a secret to derive the tenants' MLflow passwords from")
    digest = hmac.new(secret.encode(), f"opentinker-mlflow-user:{tenant}".encode(), hashlib.sha256).digest()
    return Credentials(username(tenant), base64.urlsafe_b64encode(digest).decode().rstrip("="))


def uri_with(uri: str, creds: Credentials) -> str:
    """``uri`` carrying ``creds`` as its user info: an MLflow client for one tenant without touching the process's
    environment (requests sends them as basic auth). Never print it."""
    parts = urlsplit(uri)
    host = parts.netloc.rsplit("@", 1)[-1]
    netloc = f"{quote(creds.username, safe='')}:{quote(creds.password, safe='')}@{host}"
    return urlunsplit(parts._replace(netloc=netloc))


class TenantIdentities:
    """The admin side: users, experiments and registered models of tenants, made and granted once per process."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.base = settings.mlflow_tracking_uri.rstrip("/")
        self.http = httpx.Client(
            base_url=self.base,
            auth=(settings.mlflow_admin_username, settings.mlflow_admin_password),
            timeout=60,
        )
        self._lock = threading.Lock()
        self._names = threading.Lock()
        self._users: set[str] = set()
        self._checked: dict[tuple[str, str], str] = {}

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, path: str, ok: tuple[int, ...] = (200,), **kwargs) -> httpx.Response:
        answer = self.http.request(method, path, **kwargs)
        if answer.status_code not in ok:
            raise MlflowIdentityError(
                f"MLflow server {self.base}: {method} {path} answered {answer.status_code}: {answer.text[:300]}"
            )
        return answer

    def ensure_user(self, tenant: str) -> Credentials:
        """The tenant's MLflow user, created (or its password set to the derived one) once per process."""
        creds = credentials(tenant, self.settings)
        with self._lock:
            if creds.username in self._users:
                return creds
            found = self._call("GET", "/api/2.0/mlflow/users/get", ok=(200, 404), params={"username": creds.username})
            if found.status_code == 404:
                body = {"username": creds.username, "password": creds.password}
                self._call("POST", "/api/2.0/mlflow/users/create", ok=(200, 201), json=body)
            else:  # made by an earlier process, maybe under another secret: the derived password is the one
                body = {"username": creds.username, "password": creds.password}
                self._call("PATCH", "/api/2.0/mlflow/users/update-password", json=body)
            self._users.add(creds.username)
        return creds

    def ensure_experiment(self, tenant: str) -> str:
        """The id of the tenant's experiment, made by the admin and granted to the tenant's user."""
        name = tenants.experiment(tenant)
        key = ("experiment", name)
        with self._names:
            if key not in self._checked:
                self._checked[key] = self._make_experiment(tenant, name)
            return self._checked[key]

    def _make_experiment(self, tenant: str, name: str) -> str:
        from opentinker.tracking.runs import EXPERIMENT_KIND

        user = self.ensure_user(tenant).username
        found = self._call(
            "GET", "/api/2.0/mlflow/experiments/get-by-name", ok=(200, 404), params={"experiment_name": name}
        )
        if found.status_code == 200:
            experiment_id = found.json()["experiment"]["experiment_id"]
            self._refuse_foreign("experiment", experiment_id, user, name)
        else:
            tags = [{"key": k, "value": v} for k, v in (EXPERIMENT_KIND, (EXPERIMENT_TAG[0], tenant))]
            created = self._call("POST", "/api/2.0/mlflow/experiments/create", json={"name": name, "tags": tags})
            experiment_id = created.json()["experiment_id"]
        self._grant(user, "experiment", experiment_id)
        return experiment_id

    def ensure_model(self, tenant: str, name: str) -> None:
        """The registered model ``name`` (in the tenant's namespace), made by the admin and granted to the tenant."""
        if not tenants.owns_model(tenant, name):
            raise NameTaken(f"registered model {name!r} is not in tenant {tenant}'s namespace")
        key = ("registered_model", name)
        with self._names:
            if key in self._checked:
                return
            user = self.ensure_user(tenant).username
            found = self._call("GET", "/api/2.0/mlflow/registered-models/get", ok=(200, 404), params={"name": name})
            if found.status_code == 200:
                self._refuse_foreign("registered_model", name, user, name)
            else:
                self._call("POST", "/api/2.0/mlflow/registered-models/create", json={"name": name})
            self._grant(user, "registered_model", name)
            self._checked[key] = name

    def _grant(self, user: str, resource_type: str, resource_id: str) -> None:
        """MANAGE for ``user`` (an existing grant, made by another server process, is left as it is)."""
        body = {"username": user, "resource_type": resource_type, "resource_id": resource_id, "permission": "MANAGE"}
        answer = self._call("POST", "/api/3.0/mlflow/users/permissions/grant", ok=(200, 400), json=body)
        if answer.status_code == 400 and "RESOURCE_ALREADY_EXISTS" not in answer.text:
            raise MlflowIdentityError(
                f"MLflow server {self.base}: granting {resource_type} {resource_id}: {answer.text}"
            )

    def _refuse_foreign(self, resource_type: str, resource_id: str, owner: str, name: str) -> None:
        """Refuse a name someone other than ``owner`` (and the admins) holds a grant on: made by another tenant."""
        users = self._call("GET", "/api/2.0/mlflow/users/list").json().get("users", [])
        for user in users:
            if user.get("is_admin") or user.get("username") == owner:
                continue
            for role in user.get("roles", []):
                for grant in role.get("permissions", []):
                    if grant.get("resource_type") == resource_type and grant.get("resource_pattern") == resource_id:
                        raise NameTaken(
                            f"MLflow {resource_type.replace('_', ' ')} {name!r} was made by another MLflow user "
                            f"({user.get('username')}), not by this server: refusing to write there; an operator "
                            "must delete or rename it"
                        )


_identities: dict[str, TenantIdentities] = {}
_identities_lock = threading.Lock()


def identities(settings: Settings) -> TenantIdentities:
    """One ``TenantIdentities`` per MLflow server in this process (its checks are remembered)."""
    with _identities_lock:
        found = _identities.get(settings.mlflow_tracking_uri)
        if found is None or found.settings.mlflow_admin_username != settings.mlflow_admin_username:
            found = _identities[settings.mlflow_tracking_uri] = TenantIdentities(settings)
        return found


def job_model_names(spec: RunSpec) -> list[str]:
    """Every registered model a job of ``spec`` (resolved, the tenant's prefix applied) registers."""
    name = spec.resolved_model_name
    if spec.algorithm == "group":
        return [f"{name}-{kind}" for kind in spec.engine.policy_mapping]
    return [name]
