"""The production topology on one machine (loopback), for tests and benches: every part a process of its own.

PostgreSQL (the server's database and Prefect's), a Prefect server on it, MLflow with its authentication app (one
user per tenant, ``mlflow_users``) over SeaweedFS S3 (one identity per tenant, ``s3_users``), ``api_count``
``opentinker server up --no-worker --config production.toml`` API processes on the one database behind HAProxy
(Debian's ``haproxy``), one ``opentinker server worker`` with an environment of its own (Prefect's URL and its
key file: no database, no MLflow admin, no S3 credentials: each attempt gets its tenant's from the server) that
reaches the API through the load balancer, and the operator's Ray cluster (``ray_nodes`` nodes) on which the API
processes share one Tinker engine (``tinker_ray_address``; jobs never get it: each runs a Ray of its own). The API
processes and the worker share a data dir, as machines would on shared storage. With ``worker_user`` (started as
root) the worker is that Unix user, with its own home, ``/tmp`` and a cgroup handed to it: of the shared data dir it
can reach the tenants' folders (a group of its own, setgid) and nothing of the server's. On real machines each part
is the same command on its own host (docs/deploy.md).
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from opentinker.infra.cgroups import JobCgroup, JobLimits
from opentinker.infra.cluster import LocalCluster
from opentinker.infra.files import atomic_write
from opentinker.infra.processes import ServiceError, ServiceProcess, free_ports, port_open, start, start_http, venv_bin
from opentinker.infra.services import S3Endpoint

from .tinker.remote import OPERATOR_VARIABLES, STOP_TIMEOUT_S

STARTUP_S = 300.0
"""Each service's start-up bound: a 2-core machine shared with other work starts them slowly."""
HAPROXY = """\
global
    maxconn 1024
defaults
    mode http
    option http-server-close
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response junk-response
    timeout connect 2s
    timeout client 1h
    timeout server 1h
    timeout tunnel 1h
frontend api
    bind 127.0.0.1:{port}
    stats enable
    stats uri /lb-stats
    default_backend opentinker
backend opentinker
    balance roundrobin
    option httpchk GET /healthz
    http-request disable-l7-retry unless {{ method GET HEAD }}
{servers}"""
"""Round robin over the API processes, a process out of the pool within a second of its health check failing, a
refused connection sent to another (``redispatch``), and a GET or HEAD whose process died before answering sent
again to another (``retry-on``: they are safe to repeat; a POST is never re-sent, its client decides); streams
(server-sent events, log follow) pass unbuffered and may stay open an hour; ``/lb-stats`` shows which processes are
in."""


WORKER_VIEW = (
    'mount --make-rprivate / && mount --bind /tmp "$4" && mount --bind "$1" /tmp && '
    'for kept in $5; do mkdir -p "/tmp/$kept" && mount --bind "$4/$kept" "/tmp/$kept"; done && umount "$4" && '
    'if [ -n "$2" ]; then mount --bind "$2" "$3" && '
    'mount -t tmpfs -o mode=0755 tmpfs /root && mkdir -p "$2" && mount --bind "$3" "$2"; fi && shift 5 && exec "$@"'
)
"""The worker user's machine, in a new mount namespace: ``/tmp`` its own folder ``$1`` but for the installation's
folders that live in the host's (``$5``, names under ``/tmp``, bound back through ``$4``, then unmounted); ``/root``
an empty tmpfs but for the interpreter's installation ``$2`` (bound back through ``$3``) when it lives there; then
``exec`` the rest."""


@dataclass(frozen=True)
class MlflowEndpoint:
    """An MLflow server with its authentication app and the admin the OpenTinker server acts as."""

    url: str
    admin_username: str
    admin_password: str


@dataclass
class Topology:
    """The running topology: ``url`` is the load balancer (what clients and the worker call)."""

    root: Path
    url: str = ""
    database: str = ""
    prefect_url: str = ""
    mlflow: MlflowEndpoint | None = None
    s3: S3Endpoint | None = None
    """The S3 server and the operator's admin identity on it (tenants' identities are the server's to make)."""
    config: Path | None = None
    worker_user: str = ""
    """The worker's own Unix user ('': ours)."""
    worker_cgroup: JobCgroup | None = field(default=None, repr=False)
    ray: LocalCluster | None = field(default=None, repr=False)
    """The operator's Ray cluster, where the Tinker engine runs."""
    api: list[ServiceProcess | None] = field(default_factory=list)
    api_ports: list[int] = field(default_factory=list)
    started: list[ServiceProcess] = field(default_factory=list, repr=False)
    """Everything but the API processes, in start order (``down`` stops them in reverse)."""

    @property
    def data_dir(self) -> Path:
        return self.root / "shared"

    @classmethod
    def up(
        cls,
        root: Path,
        mlflow: MlflowEndpoint | None = None,
        s3: S3Endpoint | None = None,
        api_count: int = 2,
        pool_limit: int = 2,
        worker_user: str = "",
        ray_nodes: int = 2,
        extra_settings: dict | None = None,
    ) -> Topology:
        """Start it all under ``root`` (``mlflow``: an MLflow server with users already running, over ``s3``; else
        both are started here; ``worker_user``: the worker's own Unix user, ``root`` then reachable by it;
        ``extra_settings``: more of ``production.toml``); stops what it started if a part fails."""
        from opentinker.infra.postgres import database_url, start_postgres
        from opentinker.infra.services import start_prefect

        from .launcher import PREFECT_SETTINGS

        if shutil.which("haproxy") is None:
            raise ServiceError("haproxy is missing: run ./install.sh as root (or apt-get install haproxy)")
        if worker_user:  # before anything starts: the worker runs this installation as that user, in its own /tmp
            _check_outside_tmp(root)
            _check_readable_by(
                pwd.getpwnam(worker_user), (venv_bin("opentinker"), Path(__file__).resolve().parents[1] / "__init__.py")
            )
        root.mkdir(parents=True, exist_ok=True)
        topology = cls(root=root, s3=s3, worker_user=worker_user)
        try:
            if worker_user:
                topology._share_data_dir()
            postgres, _ = start_postgres(root / "postgres", root / "postgres.log", timeout=STARTUP_S)
            topology.started.append(postgres)
            topology.database = database_url(root / "postgres", postgres, "opentinker")
            prefect_db = database_url(root / "postgres", postgres, "prefect", driver="asyncpg")
            with ThreadPoolExecutor(2) as pool:  # MLflow and Ray start while Prefect does
                own_mlflow = pool.submit(topology._start_mlflow) if mlflow is None else None
                ray = pool.submit(topology._start_ray, ray_nodes)
                prefect = start_prefect(
                    root / "prefect",
                    root / "prefect.log",
                    ui=False,
                    timeout=STARTUP_S,
                    settings={**PREFECT_SETTINGS, "PREFECT_API_DATABASE_CONNECTION_URL": prefect_db},
                )
                topology.started.append(prefect)
                topology.mlflow = mlflow or own_mlflow.result()
                ray_address = ray.result()
            topology.prefect_url = f"{prefect.url}/api"
            topology.config = root / "production.toml"
            settings = {
                "data_dir": str(topology.data_dir),
                "server_database_url": topology.database,
                "prefect_api_url": topology.prefect_url,
                "mlflow_tracking_uri": topology.mlflow.url,
                "mlflow_admin_username": topology.mlflow.admin_username,
                "mlflow_admin_password": topology.mlflow.admin_password,
                "mlflow_tenant_secret": secrets.token_urlsafe(24),
                **topology._s3_settings(),
                "server_pool_limit": pool_limit,
                "tinker_ray_address": ray_address,
                **(extra_settings or {}),
            }
            atomic_write(topology.config, "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items()), mode=0o600)
            lb_port, *topology.api_ports = free_ports(1 + api_count)
            topology.url = f"http://127.0.0.1:{lb_port}"
            topology.api = [None] * api_count
            topology._start_api(0)  # the first makes Prefect's pool, deployment and queues
            with ThreadPoolExecutor(max(api_count - 1, 1)) as pool:  # the others start while the rest does
                others = [pool.submit(topology._start_api, index) for index in range(1, api_count)]
                topology._start_balancer(lb_port)
                topology.started.append(topology._start_worker())
                for started in others:
                    started.result()
            for index in range(api_count):
                topology.wait_balanced(index)
        except BaseException:
            topology.down()
            raise
        return topology

    def _start_mlflow(self) -> MlflowEndpoint:
        from opentinker.infra.services import MlflowAuth, start_mlflow, start_s3

        s3_service, self.s3 = start_s3(self.root / "s3", self.root / "s3.log", bucket="opentinker", timeout=STARTUP_S)
        self.started.append(s3_service)
        auth = MlflowAuth("opentinker-admin", secrets.token_urlsafe(18))
        mlflow = start_mlflow(self.root / "mlflow", self.root / "mlflow.log", self.s3, auth=auth, timeout=STARTUP_S)
        self.started.append(mlflow)
        return MlflowEndpoint(mlflow.url, auth.admin_username, auth.admin_password)

    def _start_ray(self, nodes: int) -> str:
        """The operator's Ray cluster; no node inherits an operator credential (as the embedded engine's head)."""
        self.ray = LocalCluster(self.root / "ray")
        return self.ray.up(nodes=nodes, cpus_per_node=1, env=dict.fromkeys(OPERATOR_VARIABLES), timeout=STARTUP_S)

    def _share_data_dir(self) -> None:
        """The data dir as the worker user may see it: ``tenants/`` of the worker's group (setgid, so every tenant's
        folder stays the group's), the server's own folder root's only, the rest not even listable."""
        group = pwd.getpwnam(self.worker_user).pw_gid
        self.data_dir.mkdir(mode=0o711)
        (self.data_dir / "server").mkdir(mode=0o700)
        tenants = self.data_dir / "tenants"
        tenants.mkdir()
        os.chown(tenants, 0, group)
        tenants.chmod(0o2775)

    def _start_worker(self) -> ServiceProcess:
        """The worker, with its key; as ``worker_user``: its home its own folder, in a cgroup handed to it that has
        the controllers its jobs' limits need (at the machine's bounds: the jobs' own cgroups below it bound them),
        and in a mount namespace (``WORKER_VIEW``) with a ``/tmp`` of its own (root's processes keep theirs there,
        Prefect's included) holding only the installation's folders that live there (a checkout in ``/tmp``) and,
        where the interpreter lives in root's home (pyenv), a ``/root`` holding that installation alone: as a
        machine of its own would be. ``root`` must therefore lie outside ``/tmp``."""
        from .launcher import start_worker

        folder = self.root / "worker"
        folder.mkdir(exist_ok=True)
        key_file = folder / "worker.key"
        atomic_write(key_file, self.make_key("ops", ("worker",)) + "\n", mode=0o600)
        if not self.worker_user:
            return start_worker(folder / "worker.log", self.url, key_file, self.prefect_url)
        user = pwd.getpwnam(self.worker_user)
        for path in (folder, key_file):
            os.chown(path, user.pw_uid, user.pw_gid)
        folder.chmod(0o700)
        machine = JobLimits(
            memory_bytes=psutil.virtual_memory().total,
            max_processes=int(Path("/proc/sys/kernel/pid_max").read_text()),
        )
        self.worker_cgroup = JobCgroup.create(f"worker-{os.getpid()}-{secrets.token_hex(4)}", machine)
        self.worker_cgroup.delegate(user.pw_uid, user.pw_gid)
        tmp, stash, host_tmp = folder / "tmp", folder / ".interpreter", folder / ".host-tmp"
        for path in (tmp, stash, host_tmp):
            path.mkdir(exist_ok=True)
        os.chown(tmp, user.pw_uid, user.pw_gid)
        interpreter = sys.base_prefix if Path(sys.base_prefix).is_relative_to("/root") else ""
        kept = " ".join(_under_tmp(Path(sys.prefix), Path(__file__).resolve().parents[2]))
        view = ["unshare", "--mount", "/bin/sh", "-c", WORKER_VIEW, "sh", str(tmp), interpreter, str(stash)]
        view += [str(host_tmp), kept]
        as_user = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--"]
        prefix = self.worker_cgroup.wrap([*view, *as_user])
        env = {"HOME": str(folder), "TMPDIR": "/tmp", "PREFECT_HOME": str(folder / "prefect-home")}
        return start_worker(folder / "worker.log", self.url, key_file, self.prefect_url, prefix=prefix, extra_env=env)

    def _s3_settings(self) -> dict[str, str]:
        """The S3 server with the operator's identity as the admin that makes each tenant's (``s3_users``): the API
        processes hold no S3 identity of their own, the worker none at all."""
        if self.s3 is None:
            return {}
        return {
            "s3_endpoint_url": self.s3.endpoint_url,
            "s3_bucket": self.s3.bucket,
            "s3_region": self.s3.region,
            "s3_admin_access_key": self.s3.access_key,
            "s3_admin_secret_key": self.s3.secret_key,
            "s3_tenant_secret": secrets.token_urlsafe(24),
        }

    def _start_api(self, index: int) -> None:
        """API process ``index`` on its port, recorded in ``api`` as soon as it runs (so ``down`` stops it even when
        another part failed meanwhile): the machine's basics and its own Prefect home in its environment, every
        setting in the config file (a caller's own OPENTINKER_* variables would win over it)."""
        folder = self.root / f"api-{index}"
        folder.mkdir(mode=0o700, exist_ok=True)  # its home: nothing in it for a worker to read
        env = {key: os.environ[key] for key in ("PATH", "LANG", "LC_ALL", "TMPDIR") if key in os.environ}
        env.update(
            HOME=str(folder),
            PREFECT_HOME=str(folder / "prefect-home"),
            PREFECT_API_URL=self.prefect_url,
            PYTHONUNBUFFERED="1",
        )
        port = self.api_ports[index]
        cmd = [venv_bin("opentinker"), "server", "up", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--no-worker", "--config", str(self.config)]
        if self.worker_user:  # the folders it makes in tenants/ (the worker's group, setgid) the worker can write in
            cmd = ["/bin/sh", "-c", 'umask 002 && exec "$@"', "sh", *cmd]
        log = folder / "api.log"
        self.api[index] = start_http(
            f"api-{index}", cmd, log, port=port, health="/healthz", timeout=STARTUP_S, env=env, cwd=folder
        )

    def _start_balancer(self, port: int) -> None:
        servers = "".join(
            f"    server api{i} 127.0.0.1:{p} check inter 1s fall 1 rise 2\n" for i, p in enumerate(self.api_ports)
        )
        config = self.root / "haproxy.cfg"
        config.write_text(HAPROXY.format(port=port, servers=servers))
        balancer = start(
            "haproxy",
            ["haproxy", "-db", "-f", str(config)],
            self.root / "haproxy.log",
            ready=lambda: port_open(port),
            what=f"HAProxy on port {port}",
            timeout=60,
            url=self.url,
            ports={"http": port},
        )
        self.started.append(balancer)

    def make_key(
        self, tenant: str, scopes: tuple[str, ...] = ("jobs", "read", "models", "tinker"), **quotas: int | None
    ) -> str:
        """A new key of ``tenant`` (made if new, with ``quotas`` set), written to the server's database."""
        from .db import Store
        from .keys import KeyRing
        from .tenants import set_quotas

        store = Store(self.database)
        try:
            key = KeyRing(store).create(tenant, scopes)[1]
            if quotas:
                with store.session() as session:
                    set_quotas(session, tenant, **quotas)
            return key
        finally:
            store.close()

    def kill_api(self, index: int) -> None:
        """SIGKILL one API process (its process group), as a crashed machine would, and reap it."""
        os.killpg(self.api[index].pid, signal.SIGKILL)
        if self.api[index].exit_code(timeout=30) is None:
            raise ServiceError(f"API process {index} did not die")

    def start_api(self, index: int, timeout: float = 60.0) -> None:
        """Start API process ``index`` again (same port) and wait until the balancer sends it requests."""
        self._start_api(index)
        self.wait_balanced(index, timeout)

    def wait_balanced(self, index: int, timeout: float = 60.0) -> None:
        """Wait until HAProxy's health checks have API process ``index`` in (its stats page says so)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = httpx.get(f"{self.url}/lb-stats;csv", timeout=10).text.splitlines()
            if any(row.startswith(f"opentinker,api{index},") and ",UP," in row for row in rows):
                return
            time.sleep(0.2)
        raise ServiceError(f"the balancer did not take API process {index} in within {timeout:.0f} s")

    def down(self) -> None:
        """The worker and the balancer first, then the API processes, MLflow, Prefect, PostgreSQL, Ray."""
        ahead = [s for s in self.started if s.name in ("worker", "haproxy")]
        rest = [s for s in self.started if s not in ahead]
        try:
            for service in [*ahead[::-1], *(api for api in self.api if api is not None), *rest[::-1]]:
                service.stop()
        finally:
            if self.ray is not None:
                self.ray.down(STOP_TIMEOUT_S)
            if self.worker_cgroup is not None:
                self.worker_cgroup.close()


def _check_outside_tmp(root: Path) -> None:
    """The worker user gets a ``/tmp`` of its own (``WORKER_VIEW``): a root under the host's would not be there, and
    its first job would fail where the topology waited for it."""
    if root.resolve().is_relative_to("/tmp"):
        raise ServiceError(
            f"root: {root} lies under /tmp, which the worker user sees as a folder of its own: put the topology's "
            "root elsewhere (e.g. /var/lib/opentinker)"
        )


def _check_readable_by(user: pwd.struct_passwd, paths: tuple[str | Path, ...]) -> None:
    """The worker runs this installation as ``user``: a folder above it closed to others (a clone made with
    ``mktemp -d``, mode 0700) would end the worker at its first exec while the topology waited for its jobs."""
    for path in paths:
        as_user = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--"]
        if subprocess.run([*as_user, "test", "-r", str(path)], check=False).returncode != 0:
            raise ServiceError(
                f"worker_user: {user.pw_name} cannot read {path}: open the folders above it to others "
                "(chmod o+rx), or install where that user can read"
            )


__all__ = ["MlflowEndpoint", "Topology"]


def _under_tmp(*paths: Path) -> list[str]:
    """The first folder under ``/tmp`` of each path that lies there (the venv, the checkout), once each."""
    names = [path.resolve().relative_to("/tmp").parts[0] for path in paths if path.resolve().is_relative_to("/tmp")]
    return sorted(set(names))
