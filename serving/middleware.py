"""Small ASGI middlewares shared by the services: a request-body limit and a computed response header."""

from __future__ import annotations

from collections.abc import Callable

from .auth import _send_json


class BodyLimitMiddleware:
    """Reject bodies over ``max_bytes`` with 413 before the app parses them.

    A declared ``Content-Length`` is checked up front; a chunked body is read here up to the limit and
    replayed to the app, so an oversized stream is never buffered whole.

    The rest of an oversized body is read and dropped before the 413 goes out (up to ``drain_bytes``): a client
    sends its whole body before it reads the answer, and a server that closes the connection with unread bytes
    makes the kernel reset it, so the client saw "connection reset" instead of the 413. Past ``drain_bytes`` the
    connection is closed after the answer (``Connection: close``).
    """

    def __init__(self, app, max_bytes: int, drain_bytes: int | None = None, error_field: str = "error"):
        self.app = app
        self.max_bytes = max_bytes
        self.error_field = error_field
        self.drain_bytes = max(64 << 20, 8 * max_bytes) if drain_bytes is None else drain_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await _send_json(send, 400, {"error": "Content-Length: expected a non-negative integer"})
            if int(declared) > self.max_bytes:
                return await self._too_large(receive, send, drained=0, declared=int(declared))
            return await self.app(scope, receive, send)
        if scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                more = message.get("more_body", False)
                return await self._too_large(receive, send, drained=size, declared=None if more else size)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, receive, send, drained: int, declared: int | None):
        """Drain what is left of the body (see the class docstring), then answer 413."""
        finished = declared is not None and declared <= drained
        if not finished and (declared is None or declared <= self.drain_bytes):
            while drained <= self.drain_bytes:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                drained += len(message.get("body", b""))
                if not message.get("more_body", False):
                    finished = True
                    break
        await _send_json(
            send,
            413,
            {self.error_field: f"request body: expected at most {self.max_bytes} bytes"},
            extra_headers=[] if finished else [(b"connection", b"close")],
        )


class JsonBodyMiddleware:
    """Answer 415 to a POST whose declared Content-Type is not JSON (an absent one is taken as JSON).

    Without this, BentoML would parse form or text bodies as empty input and report a misleading
    "field required".
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            media_type = (_header(scope, b"content-type") or "application/json").split(";")[0].strip().lower()
            if media_type != "application/json":
                return await _send_json(
                    send, 415, {"error": f"Content-Type: expected application/json, got {media_type}"}
                )
        await self.app(scope, receive, send)


class ResponseHeaderMiddleware:
    """Add ``name: value_fn()`` to every response that the app did not already label itself."""

    def __init__(self, app, name: str, value_fn: Callable[[], str]):
        self.app = app
        self.name = name.lower().encode("latin-1")
        self.value_fn = value_fn

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(key.lower() == self.name for key, _ in headers):
                    headers.append((self.name, self.value_fn().encode("latin-1")))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_header)


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1").strip()
    return None
