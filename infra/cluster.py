"""A real multi-node Ray cluster on loopback: one head raylet plus worker raylets, each its own process tree.

Every node runs ``ray start --block`` in its own process group, so stopping a node stops exactly its raylet,
object store and workers (never ``ray stop``, which would kill every Ray on the machine). Worker nodes
advertise the ``rollout_node`` resource so placement on them is observable and requestable.
State lives in ``<data_dir>/cluster/state.json``; the Ray session files live in a short /tmp dir
(Unix socket paths must stay under ~100 characters).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from opentinker.infra.files import atomic_write
from opentinker.infra.processes import ServiceError, ServiceProcess, free_ports, log_tail, start, venv_bin
from opentinker.infra.settings import Settings, get_settings

WORKER_RESOURCE = "rollout_node"
READY_MARKER = "will now block forever"
STARTUP_TIMEOUT_MARKER = "timed out during startup"
STARTUP_NICE = -10


class ClusterError(RuntimeError):
    """The cluster cannot be started, joined or stopped; the message says why."""


class ClusterResourceError(RuntimeError):
    """The Ray cluster cannot provide what the config asks for; the message names the setting or field."""


@dataclass
class NodeStatus:
    name: str
    running: bool
    pid: int | None
    node_manager_port: int
    log: str


class LocalCluster:
    """Start, inspect and stop a loopback Ray cluster recorded under ``root`` (default ``<data_dir>/cluster``)."""

    def __init__(self, root: Path | None = None, settings: Settings | None = None):
        self.settings = settings or get_settings()
        self.root = (root or self.settings.resolved_data_dir / "cluster").resolve()
        self.state_path = self.root / "state.json"

    def _state(self) -> dict:
        if not self.state_path.exists():
            return {"nodes": {}}
        return json.loads(self.state_path.read_text())

    def _write_state(self, state: dict) -> None:
        atomic_write(self.state_path, json.dumps(state, indent=2), mode=0o600)

    def nodes(self) -> dict[str, ServiceProcess]:
        return {name: ServiceProcess.from_dict(data) for name, data in self._state()["nodes"].items()}

    @property
    def address(self) -> str:
        """GCS address ``127.0.0.1:PORT`` that ``OPENTINKER_RAY_ADDRESS`` should hold (empty when not up)."""
        head = self.nodes().get("head")
        return f"127.0.0.1:{head.ports['gcs']}" if head and head.alive() else ""

    def up(
        self,
        nodes: int = 2,
        cpus_per_node: int = 1,
        object_store_mb: int = 512,
        timeout: float = 180.0,
        gpus: int | None = 0,
        env: Mapping[str, str | None] | None = None,
    ) -> str:
        """Start a head (``nodes`` counts it) and ``nodes - 1`` workers; returns the cluster address. ``gpus``: the
        head's (None: the GPUs Ray finds); ``env``: over this process's environment for every node, a None value
        withholding the variable (so no Ray worker inherits it)."""
        if nodes < 1:
            raise ClusterError(f"nodes must be >= 1 (the head counts as one), got {nodes}")
        if cpus_per_node < 1:
            raise ClusterError(f"cpus_per_node must be >= 1, got {cpus_per_node}")
        if any(node.alive() for node in self.nodes().values()):
            raise ClusterError(
                f"a cluster from {self.state_path} is still running; run `opentinker cluster down` first."
            )
        temp_dir = tempfile.mkdtemp(prefix="otray-", dir="/tmp")
        state = {"nodes": {}, "temp_dir": temp_dir}
        started: list[ServiceProcess] = []
        try:
            head = self._start_node("head", None, cpus_per_node, object_store_mb, temp_dir, timeout, env=env, gpus=gpus)
            started.append(head)
            address = f"127.0.0.1:{head.ports['gcs']}"
            for index in range(1, nodes):
                started.append(
                    self._start_node(
                        f"worker-{index}", address, cpus_per_node, object_store_mb, temp_dir, timeout, env=env
                    )
                )
        except BaseException as exc:
            report = _head_report(started[0], temp_dir) if started and isinstance(exc, ServiceError) else ""
            for node in reversed(started):
                node.stop()
            shutil.rmtree(temp_dir, ignore_errors=True)
            if isinstance(exc, ServiceError):
                raise ClusterError(f"{exc}{report}") from exc
            raise
        state["nodes"] = {node.name: node.to_dict() for node in started}
        state["next_worker"] = nodes
        self._write_state(state)
        return address

    def add_worker(self, cpus_per_node: int = 1, object_store_mb: int = 512, timeout: float = 180.0) -> ServiceProcess:
        """Join one more worker node to the running cluster (e.g. to replace a lost one)."""
        state = self._state()
        if not self.address:
            raise ClusterError("no running cluster to join; run `opentinker cluster up` first.")
        index = state.get("next_worker", len(state["nodes"]))  # never reuse a name (or its log) within a cluster
        try:
            node = self._start_node(
                f"worker-{index}", self.address, cpus_per_node, object_store_mb, state["temp_dir"], timeout
            )
        except ServiceError as exc:
            raise ClusterError(f"{exc}{_head_report(self.nodes()['head'], state['temp_dir'])}") from exc
        state["nodes"][node.name] = node.to_dict()
        state["next_worker"] = index + 1
        self._write_state(state)
        return node

    def stop_node(self, name: str) -> None:
        """Stop one node (its whole process tree) and forget it."""
        state = self._state()
        if name not in state["nodes"]:
            raise ClusterError(f"no node named {name!r}; known: {', '.join(state['nodes']) or 'none'}")
        ServiceProcess.from_dict(state["nodes"].pop(name)).stop()
        self._write_state(state)

    def down(self, timeout: float | None = None) -> list[str]:
        """Stop workers first, then the head (each killed after ``timeout`` s, default its own); returns the names of
        nodes that were running."""
        state = self._state()
        stopped = []
        for name, node in sorted(self.nodes().items(), key=lambda item: item[0] == "head"):
            if node.alive():
                node.stop(timeout)
                stopped.append(name)
        if state.get("temp_dir"):
            shutil.rmtree(state["temp_dir"], ignore_errors=True)
        if self.state_path.exists():
            self._write_state({"nodes": {}})
        return stopped

    def status(self) -> list[NodeStatus]:
        return [
            NodeStatus(name, node.alive(), node.pid if node.alive() else None, node.ports["node_manager"], node.log)
            for name, node in self.nodes().items()
        ]

    def _start_node(
        self,
        name: str,
        head_address: str | None,
        cpus: int,
        object_store_mb: int,
        temp_dir: str,
        timeout: float,
        attempts: int = 3,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str | None] | None = None,
        gcs_port: int | None = None,
        gpus: int | None = 0,
    ) -> ServiceProcess:
        """``ray start`` gives a raylet a fixed 30 s to register; on a loaded machine its agent can be slower: retry.

        ``extra_args`` go to ``ray start``, ``env`` is added to its environment (a None value withheld) and
        ``gcs_port`` fixes the head's GCS port (the autoscaling head needs all three: its autoscaler config names the
        GCS address); ``gpus`` the node's GPUs (None: those Ray finds)."""
        for attempt in range(1, attempts + 1):
            try:
                return self._start_node_once(
                    name, head_address, cpus, object_store_mb, temp_dir, timeout, extra_args, env, gcs_port, gpus
                )
            except ServiceError as exc:
                if attempt == attempts or STARTUP_TIMEOUT_MARKER not in str(exc):
                    raise
        raise ClusterError(f"{name} did not start")  # not reached: the last attempt re-raises

    def _start_node_once(
        self,
        name: str,
        head_address: str | None,
        cpus: int,
        object_store_mb: int,
        temp_dir: str,
        timeout: float,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str | None] | None = None,
        gcs_port: int | None = None,
        gpus: int | None = 0,
    ) -> ServiceProcess:
        keys = ["node_manager", "object_manager", "agent_http", "agent_grpc", "runtime_env", "metrics"]
        if head_address is None:
            keys += ["gcs", "client"]
        ports = dict(zip(keys, free_ports(len(keys))))
        if gcs_port is not None:
            ports["gcs"] = gcs_port
        cmd = [
            venv_bin("ray"),
            "start",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={cpus}",
            *([f"--num-gpus={gpus}"] if gpus is not None else []),
            f"--object-store-memory={object_store_mb * 1024 * 1024}",
            f"--temp-dir={temp_dir}",
            f"--node-manager-port={ports['node_manager']}",
            f"--object-manager-port={ports['object_manager']}",
            f"--dashboard-agent-listen-port={ports['agent_http']}",
            f"--dashboard-agent-grpc-port={ports['agent_grpc']}",
            f"--runtime-env-agent-port={ports['runtime_env']}",
            f"--metrics-export-port={ports['metrics']}",
            "--min-worker-port=0",
            "--max-worker-port=0",
            "--disable-usage-stats",
            "--log-style=record",
            *extra_args,
        ]
        if head_address is None:
            cmd += [
                "--head",
                f"--port={ports['gcs']}",
                f"--ray-client-server-port={ports['client']}",
                "--include-dashboard=false",
            ]
            url = f"127.0.0.1:{ports['gcs']}"
        else:
            cmd += [f"--address={head_address}", f"--resources={json.dumps({WORKER_RESOURCE: 1})}"]
            url = head_address
        # Ray gives a new raylet a hard-coded 30 s to register (agents included); on a busy machine the node's
        # session would not get enough CPU for that, so it gets a higher share while starting, then the normal one.
        return start(
            name,
            cmd,
            self.root / "logs" / f"{name}.log",
            ready=READY_MARKER,
            what="`ray start` reported the node up",
            timeout=timeout,
            url=url,
            ports=ports,
            env={k: v for k, v in {**os.environ, **env}.items() if v is not None} if env else None,
            stop_timeout=20.0,
            startup_nice=STARTUP_NICE,
        )


def _head_report(head: ServiceProcess, temp_dir: str) -> str:
    """Whether the head a worker failed to join is alive, and its GCS's last words (the worker's log shows only
    that it could not connect)."""
    state = "running" if head.alive() else "not running"
    logs = sorted(Path(temp_dir).glob("session_*/logs/gcs_server.out"), key=lambda path: path.stat().st_mtime)
    if not logs:
        return f" The head is {state}; it wrote no GCS log under {temp_dir}."
    return f" The head is {state}; last lines of {logs[-1]}:\n{log_tail(logs[-1], lines=15)}"
