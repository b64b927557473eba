"""The only way out of a job's sandbox: a filtering proxy to Prefect's API (and the job's progress to the server).

A job's sandbox has its own network namespace with nothing but its loopback. Inside it, ``job_entry`` forwards
``127.0.0.1:PROXY_PORT`` to a Unix socket bound into the sandbox, where this proxy, running in the worker, answers.
The job's Prefect client sends the attempt's token as its API auth string (Basic auth over HTTP, the first message of
the events websocket); the proxy knows which flow run each token belongs to and lets a request through only if it is
about that flow run: reading it, its deployment and flow, setting its state, creating and updating its own task runs,
writing its own logs and artifacts, emitting events about it. Anything else answers 403 and never reaches Prefect,
whose open-source server has no tenants of its own. The token is removed before the request goes on.

So a hostile job reads no other tenant's specs or logs from Prefect, changes no other run's state, and reaches no
other service on the host (the server's API, MLflow, S3, another job's Ray): docs/service.md, "Isolation".
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger("opentinker.server.job_proxy")

PROXY_PORT = 4200
"""The port the job's Prefect client talks to, on the sandbox's own loopback."""
PROGRESS_PATH = "/opentinker/progress"
OPEN_READS = ("/api/health", "/api/hello", "/api/admin/version", "/api/admin/storage", "/api/csrf-token")
"""Reads the engine makes that hold no run's data: health, version, the server's default result storage."""
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


@dataclass
class Attempt:
    """One running job attempt as the proxy knows it."""

    job_id: str
    flow_run_id: str
    reads: set[str] = field(default_factory=set)
    """Paths of its own deployment, flow, work queue and pool (learned from its flow run)."""
    task_runs: set[str] = field(default_factory=set)
    """Its task runs (created over HTTP or announced by events about its flow run)."""


class JobProxy:
    """The proxy of one worker: an ASGI app on a Unix socket, in a thread of its own."""

    def __init__(self, socket_path: Path, prefect_api_url: str, server_url: str):
        self.socket_path = socket_path
        self.prefect = prefect_api_url.rstrip("/")
        self.server = server_url.rstrip("/")
        self.attempts: dict[str, Attempt] = {}
        self._lock = threading.Lock()
        self._started = threading.Event()
        self._server = None
        self._http_client: httpx.AsyncClient | None = None

    # -- attempts -------------------------------------------------------------------------------------------------

    def admit(self, token: str, attempt: Attempt) -> None:
        with self._lock:
            self.attempts[token] = attempt

    def dismiss(self, token: str) -> None:
        with self._lock:
            self.attempts.pop(token, None)

    def _attempt(self, token: str | None) -> Attempt | None:
        with self._lock:
            return self.attempts.get(token) if token else None

    # -- serving --------------------------------------------------------------------------------------------------

    def start(self) -> None:
        threading.Thread(target=self._serve, name="job-proxy", daemon=True).start()
        if not self._started.wait(60):
            raise RuntimeError(f"the job proxy did not start on {self.socket_path}")

    def _serve(self) -> None:
        import uvicorn

        config = uvicorn.Config(
            self.app,
            interface="asgi3",
            uds=str(self.socket_path),
            log_level="warning",
            access_log=False,
            ws="websockets",
        )
        self._server = uvicorn.Server(config)
        startup = self._server.startup

        async def started(sockets=None):
            await startup(sockets=sockets)
            self._http_client = httpx.AsyncClient(timeout=120)
            self._started.set()

        self._server.startup = started
        asyncio.run(self._server.serve())

    async def app(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "websocket":
            await self._websocket(scope, receive, send)

    # -- HTTP -----------------------------------------------------------------------------------------------------

    async def _http(self, scope, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        attempt = self._attempt(_basic_token(headers.get("authorization", "")))
        method, path = scope["method"], scope["path"]
        query = scope.get("query_string", b"").decode()
        if attempt is None:
            return await _answer(send, 401, {"detail": "no job attempt behind this token"})
        if path == PROGRESS_PATH:
            return await self._progress(send, attempt, headers, body)
        verdict = self._allowed(attempt, method, path, body)
        if verdict is not True:
            logger.warning("job %s: refused %s %s (%s)", attempt.job_id, method, path, verdict)
            return await _answer(send, 403, {"detail": f"not this job's flow run: {verdict}"})
        forwarded = {k: v for k, v in headers.items() if k not in ("authorization", "host", "content-length")}
        url = f"{self.prefect}{path.removeprefix('/api')}" + (f"?{query}" if query else "")
        answer = await self._http_client.request(method, url, content=body, headers=forwarded)
        self._learn(attempt, method, path, answer)
        await send(
            {
                "type": "http.response.start",
                "status": answer.status_code,
                "headers": [
                    (k.encode("latin-1"), v.encode("latin-1"))
                    for k, v in answer.headers.items()
                    if k.lower() not in ("content-length", "transfer-encoding", "content-encoding", "connection")
                ]
                + [(b"content-length", str(len(answer.content)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": answer.content})

    async def _progress(self, send, attempt: Attempt, headers: dict[str, str], body: bytes) -> None:
        token = _basic_token(headers.get("authorization", ""))
        try:
            answer = await self._http_client.post(
                f"{self.server}/v1/internal/jobs/{attempt.job_id}/progress",
                content=body,
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            )
            status = answer.status_code
        except httpx.HTTPError:
            status = 502
        await _answer(send, status, None)

    def _allowed(self, attempt: Attempt, method: str, path: str, body: bytes) -> bool | str:
        """True, or why not: each rule is one operation of Prefect's engine on its own flow run (seen by running a
        job through this proxy); everything else is refused."""
        own = attempt.flow_run_id
        if method == "GET" and path in OPEN_READS:
            return True
        if re.fullmatch(rf"/api/flow_runs/{own}(/.*)?", path):
            return True if method in ("GET", "POST", "PATCH") else f"{method} on the flow run"
        if method == "POST" and path == "/api/flow_runs/filter":  # the engine asks whether it is suspended
            ids = (_json(body).get("flow_runs") or {}).get("id", {}).get("any_") or []
            return True if ids and set(ids) == {own} else "a filter over other flow runs"
        if method == "GET" and path in attempt.reads:
            return True
        match = re.fullmatch(rf"/api/task_runs/({UUID})(/.*)?", path)
        if match:
            return True if match[1] in attempt.task_runs else "another task run"
        if method == "POST" and path == "/api/task_runs/":
            return True if _json(body).get("flow_run_id") == own else "a task run of another flow run"
        if method == "POST" and path in ("/api/logs/", "/api/artifacts/"):
            data = _json(body)
            entries = data if isinstance(data, list) else [data]
            return True if all(entry.get("flow_run_id") == own for entry in entries) else "another run's"
        return f"{method} {path} is not an operation on this job's flow run"

    def _learn(self, attempt: Attempt, method: str, path: str, answer: httpx.Response) -> None:
        """Remember what the engine's own calls reveal: its task runs, and its deployment, flow, queue and pool."""
        if answer.status_code >= 400:
            return
        if path == "/api/task_runs/" and method == "POST":
            attempt.task_runs.add(answer.json()["id"])
        elif method == "GET" and path == f"/api/flow_runs/{attempt.flow_run_id}":
            run = answer.json()
            attempt.reads = {
                f"/api/deployments/{run.get('deployment_id')}",
                f"/api/flows/{run.get('flow_id')}",
                f"/api/work_queues/{run.get('work_queue_id')}",
                f"/api/work_pools/{run.get('work_pool_name')}",
            }

    # -- events ---------------------------------------------------------------------------------------------------

    async def _websocket(self, scope, receive, send) -> None:
        if scope["path"] != "/api/events/in":
            await send({"type": "websocket.close", "code": 4403})
            return
        await receive()  # websocket.connect
        await send({"type": "websocket.accept", "subprotocol": "prefect"})
        first = await receive()
        attempt = None
        if first["type"] == "websocket.receive":
            attempt = self._attempt(_json((first.get("text") or "").encode()).get("token"))
        if attempt is None:
            await send({"type": "websocket.send", "text": json.dumps({"type": "auth_failure", "reason": "no job"})})
            await send({"type": "websocket.close", "code": 4401})
            return
        await send({"type": "websocket.send", "text": json.dumps({"type": "auth_success"})})
        import websockets

        upstream_url = self.prefect.replace("http://", "ws://").replace("https://", "wss://") + "/events/in"
        async with websockets.connect(upstream_url, subprotocols=["prefect"]) as upstream:
            await upstream.send(json.dumps({"type": "auth", "token": None}))
            await upstream.recv()
            while True:
                message = await receive()
                if message["type"] != "websocket.receive":
                    return
                raw = message.get("text") or message.get("bytes") or b""
                event = _json(raw.encode() if isinstance(raw, str) else raw)
                if _event_is_own(event, attempt):
                    await upstream.send(message.get("text") or message.get("bytes"))
                else:
                    logger.warning("job %s: dropped an event about %s", attempt.job_id, event.get("resource", {}))


def _event_is_own(event: dict[str, Any], attempt: Attempt) -> bool:
    """An event about the job's own flow run, or about something of it (its task runs, artifacts) that names the flow
    run as related; never one about another flow run, deployment, queue or pool. Task runs seen here are learned."""
    resource = str((event.get("resource") or {}).get("prefect.resource.id", ""))
    kind, _, ident = resource.rpartition(".")
    if kind == "prefect.flow-run":
        return ident == attempt.flow_run_id
    if kind in ("prefect.deployment", "prefect.flow", "prefect.work-queue", "prefect.work-pool", "prefect.worker"):
        return False
    related = {str(item.get("prefect.resource.id")) for item in event.get("related") or [] if isinstance(item, dict)}
    if f"prefect.flow-run.{attempt.flow_run_id}" not in related:
        return False
    if kind == "prefect.task-run":
        attempt.task_runs.add(ident)
    return True


def _basic_token(authorization: str) -> str | None:
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(value).decode()
        except ValueError:
            return None
    return value or None if scheme.lower() == "bearer" else None


def _json(data: bytes) -> Any:
    try:
        return json.loads(data or b"{}")
    except ValueError:
        return {}


async def _answer(send, status: int, body: dict | None) -> None:
    payload = json.dumps(body).encode() if body is not None else b""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
