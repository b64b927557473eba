"""Flower's deployment engine on loopback: one `flower-superlink` and one `flower-supernode` per site, each its own
process group, TLS from `federated.certs`, SuperNode authentication (each site's public key registered up front).

State lives in ``<root>/federation.json`` so `opentinker federated up`, `run` and `down` can be separate commands.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from opentinker.federated import warm_executor
from opentinker.federated.certs import CertPaths, generate_certs
from opentinker.federated.config import FedConfig, FederatedConfigError, SiteConfig
from opentinker.infra.files import atomic_write
from opentinker.infra.processes import ServiceError, ServiceProcess, free_ports, start, venv_bin
from opentinker.infra.settings import get_settings

STATE_FILE = "federation.json"
APP_DIR = Path(__file__).resolve().parents[1]
"""The repository root: its pyproject.toml carries the Flower app ([tool.flwr.app])."""


class FederationError(ServiceError):
    """A Flower process failed to start, was refused, or a run failed; the message carries its log tail."""


TRANSPORTS = ("rest",)
"""How SuperNodes reach the SuperLink. flwr 1.42 has one Fleet transport: "rest", protobuf over HTTPS (HTTP/1.1,
TLS, through httpx), which firewalls and proxies that block gRPC let through. Its SuperNode no longer speaks gRPC."""


def check_transport(transport: str) -> str:
    """``transport`` as one of ``TRANSPORTS`` ("http"/"https" mean "rest"); other names get the article's fix."""
    name = str(transport).strip().lower()
    if name in ("rest", "http", "https"):
        return "rest"
    raise FederatedConfigError(
        f"transport={transport!r}: this Flower (1.42) connects sites over one transport, 'rest' (Fleet API over "
        "HTTPS); it has no gRPC or WebSocket transport. 'rest' is what a site behind a firewall that blocks gRPC "
        "needs: pass transport='rest' (the default)"
    )


CONNECTION_RESET_MARKERS = ("Connection reset by peer", "ConnectionResetError", "RemoteProtocolError")


def connection_hint(log_text: str, address: str) -> str:
    """The article's troubleshooting line for a reset connection, when the SuperNode's log shows one."""
    if not any(marker in log_text for marker in CONNECTION_RESET_MARKERS):
        return ""
    return (
        f"ConnectionReset: the connection to the SuperLink at {address} was reset. Likely cause: a firewall or "
        "proxy that blocks gRPC-style traffic or resets long-lived connections on that port. Fix: sites already "
        "use Flower's REST transport (transport='rest', HTTPS on one port): allow HTTPS to that port, or set "
        "HTTPS_PROXY to a proxy that lets it through.\n"
    )


def default_root() -> Path:
    return get_settings().resolved_data_dir / "federated" / "deployment"


@dataclass
class Federation:
    """A running loopback federation: where its files are and which processes are its parts."""

    root: str
    port: int
    certs: str
    transport: str = "rest"
    superlink: ServiceProcess | None = None
    sites: dict[str, ServiceProcess] = field(default_factory=dict)
    """Each running site's flower-supernode, by site id."""
    executors: dict[str, ServiceProcess] = field(default_factory=dict)
    """Each running site's warm executor (``federated.warm_executor``), which runs its ClientApp tasks."""
    node_ids: dict[str, int] = field(default_factory=dict)

    @property
    def superlink_pid(self) -> int:
        return self.superlink.pid if self.superlink else 0

    @property
    def site_pids(self) -> dict[str, int]:
        return {site: service.pid for site, service in self.sites.items()}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def cert_paths(self) -> CertPaths:
        return CertPaths(Path(self.certs))

    @property
    def cli_home(self) -> Path:
        return Path(self.root) / "cli-home"

    def save(self) -> None:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["superlink"] = self.superlink.to_dict() if self.superlink else None
        data["sites"] = {site: service.to_dict() for site, service in self.sites.items()}
        data["executors"] = {site: service.to_dict() for site, service in self.executors.items()}
        atomic_write(Path(self.root) / STATE_FILE, json.dumps(data, indent=1))

    @classmethod
    def load(cls, root: str | Path | None = None) -> Federation:
        path = Path(root or default_root()) / STATE_FILE
        if not path.exists():
            raise FederationError(f"no federation at {path.parent}: start one with `opentinker federated up`")
        data = json.loads(path.read_text())
        superlink = ServiceProcess.from_dict(data["superlink"]) if data.get("superlink") else None
        sites, executors = (
            {site: ServiceProcess.from_dict(service) for site, service in data.get(key, {}).items()}
            for key in ("sites", "executors")
        )
        return cls(**{**data, "superlink": superlink, "sites": sites, "executors": executors})


TASK_POLL_S = 0.1
"""Seconds between a SuperExec's asks for a new task (Flower's ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``, 1 s by default):
the SuperLink's SuperExec waits up to this long before it starts a run's ServerApp."""


def _env(flwr_home: Path) -> dict[str, str]:
    flwr_home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", str(TASK_POLL_S))
    env["FLWR_HOME"] = str(flwr_home)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OPENTINKER_DATA_DIR", str(get_settings().resolved_data_dir))
    return env


def _start(name: str, args: list[str], log: Path, flwr_home: Path, ready: str, timeout: float) -> ServiceProcess:
    """A Flower process in its own session, returned once its log shows ``ready``; stopped with its whole group
    (flower-supernode leaves a flower-superexec child otherwise)."""
    return start(
        name,
        args,
        log,
        ready=ready,
        what=f"its log showed {ready!r}",
        timeout=timeout,
        env=_env(flwr_home),
        stop_timeout=20.0,
        error=FederationError,
    )


def _flwr(fed: Federation, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [venv_bin("flwr"), *args], env=_env(fed.cli_home), capture_output=True, text=True, timeout=timeout
    )


def start_superlink(root: Path, certs: CertPaths, timeout: float = 180.0, transport: str = "rest") -> Federation:
    """flower-superlink with TLS and SuperNode auth; its Fleet API serves ``transport`` (see ``TRANSPORTS``)."""
    (port,) = free_ports(1)
    fed = Federation(root=str(root), port=port, certs=str(certs.directory), transport=check_transport(transport))
    fed.superlink = _start(
        "flower-superlink",
        [
            venv_bin("flower-superlink"),
            "--ssl-certfile",
            str(certs.server_cert),
            "--ssl-keyfile",
            str(certs.server_key),
            "--ssl-ca-certfile",
            str(certs.ca_cert),
            "--enable-supernode-auth",
            "--disable-runtime-dependency-installation",
            "--database",
            str(root / "superlink.db"),
            "--host",
            "127.0.0.1",
            "--port",
            str(fed.port),
        ],
        root / "superlink.log",
        root / "superlink-home",
        "Uvicorn running",
        timeout,
    )
    fed.cli_home.mkdir(parents=True, exist_ok=True)
    (fed.cli_home / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "{fed.address}"\n'
        f'root-certificates = "{certs.ca_cert}"\n'
    )
    fed.save()
    return fed


def register_site(fed: Federation, site: int, public_key: Path) -> int:
    """Register a site's public key with the SuperLink (SuperNode authentication); returns its node id."""
    done = _flwr(fed, "supernode", "register", str(public_key), "local", "--format", "json")
    try:
        node_id = int(json.loads(done.stdout)["node-id"])
    except (ValueError, KeyError) as err:
        raise FederationError(f"registering site {site} failed ({err}):\n{done.stdout}\n{done.stderr}") from err
    fed.node_ids[str(site)] = node_id
    fed.save()
    return node_id


def start_site(
    fed: Federation,
    site: SiteConfig,
    private_key: Path | None = None,
    root_cert: Path | None = None,
    timeout: float = 180.0,
    max_wait_time: float | None = None,
    address: str | None = None,
    transport: str = "rest",
) -> int:
    """Start a site's flower-supernode (TLS + its auth key) over ``transport`` to ``address`` (the SuperLink's by
    default) and wait until the SuperLink accepted it; returns its pid. A reset connection says so, with the fix.

    The SuperNode runs in Flower's ``--isolation process`` mode: its tasks are claimed by the site's long-running
    ``federated.warm_executor`` (its own process group, authenticated with a per-site SuperExec secret, mode 0600),
    so no message pays for a Python + Flower + torch start. ``stop_site`` stops both.
    """
    check_transport(transport)
    address = address or fed.address
    key = private_key or fed.cert_paths.site_key(site.site_id)
    site_dir = Path(fed.root) / f"site-{site.site_id}"
    site_dir.mkdir(parents=True, exist_ok=True)
    if not site.state_dir:
        site.state_dir = str(site_dir / "state")
    secret = site_dir / "superexec.secret"
    if not secret.exists():
        secret.touch(mode=0o600)
        secret.write_bytes(os.urandom(32))
    (runtime_port,) = free_ports(1)
    args = [
        venv_bin("flower-supernode"),
        "--superlink",
        address,
        "--root-certificates",
        str(root_cert or fed.cert_paths.ca_cert),
        "--auth-supernode-private-key",
        str(key),
        "--port",
        str(runtime_port),
        "--node-config",
        site.to_node_config() or f"site-id={site.site_id}",
        "--isolation",
        "process",
        "--superexec-auth-secret-file",
        str(secret),
    ]
    if max_wait_time is not None:
        args += ["--max-wait-time", str(max_wait_time)]
    name = f"site {site.site_id} (flower-supernode)"
    try:
        service = _start(name, args, site_dir / "supernode.log", site_dir / "flwr-home", "SuperNode ID:", timeout)
    except FederationError as err:
        hint = connection_hint(err.service.log_text() if err.service else "", address)
        if hint:
            raise FederationError(hint + str(err), err.service) from err
        raise
    executor_args = [
        sys.executable,
        "-c",
        "from opentinker.federated.warm_executor import main; main()",
        "--runtime-api-address",
        f"127.0.0.1:{runtime_port}",
        "--auth-secret-file",
        str(secret),
        "--parent-pid",
        str(service.pid),
    ]
    executor_name = f"site {site.site_id} (warm executor)"
    try:
        executor = _start(
            executor_name,
            executor_args,
            site_dir / "executor.log",
            site_dir / "flwr-home",
            warm_executor.READY_MARKER,
            timeout,
        )
    except BaseException:
        service.stop()
        raise
    fed.sites[str(site.site_id)] = service
    fed.executors[str(site.site_id)] = executor
    fed.save()
    return service.pid


def stop_site(fed: Federation, site_id: int) -> None:
    for services in (fed.sites, fed.executors):
        service = services.pop(str(site_id), None)
        if service is not None:
            service.stop()
    fed.save()


def up(
    sites: int = 3,
    root: str | Path | None = None,
    site_configs: list[SiteConfig] | None = None,
    transport: str = "rest",
) -> Federation:
    """Certificates (kept if present), SuperLink, every site's key registered, one SuperNode per site."""
    root = Path(root or default_root()).resolve()
    root.mkdir(parents=True, exist_ok=True)
    certs = generate_certs(root / "certs", sites)
    fed = start_superlink(root, certs, transport=transport)
    try:
        for site in site_configs or [SiteConfig(site_id=i) for i in range(sites)]:
            register_site(fed, site.site_id, certs.site_public_key(site.site_id))
            start_site(fed, site, transport=transport)
    except Exception:
        down(root)
        raise
    return fed


def down(root: str | Path | None = None) -> None:
    """Stop every SuperNode, then the SuperLink, and wait for each process group to go."""
    fed = Federation.load(root)
    for site_id in list(fed.sites):
        stop_site(fed, int(site_id))
    if fed.superlink is not None:
        fed.superlink.stop()
    fed.superlink = None
    fed.save()


def submit(fed: Federation, config: FedConfig, timeout: float = 3600.0):
    """`flwr run` the app against the federation, stream until it ends, return the server's FederatedResult."""
    from opentinker.federated.server_app import checkpoint_dir, read_result

    result_file = checkpoint_dir(config) / "result.json"
    result_file.unlink(missing_ok=True)
    overrides = Path(fed.root) / f"run-config-{config.run_name}.toml"
    overrides.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in config.to_run_config().items()))
    done = _flwr(fed, "run", str(APP_DIR), "local", "--run-config", str(overrides), "--stream", timeout=timeout)
    (Path(fed.root) / f"run-{config.run_name}.log").write_text(done.stdout + done.stderr)
    result = read_result(config)
    if result is None or result.status != "FINISHED":
        reason = result.error if result else "the ServerApp wrote no result"
        raise FederationError(
            f"federated run {config.run_name!r} failed: {reason}\n{(done.stdout + done.stderr)[-3000:]}"
        )
    return result
