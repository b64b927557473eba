"""The server's errors, one definition each, as its routes answer them: every route turns an ``ServerError`` into
its status and ``{"detail": "<one line>"}`` (``Retry-After`` where it says how long to wait).

The Tinker SDK acts on the status: it retries 408, 409, 429 and 5xx (10 times, honouring ``Retry-After``), re-submits on
410, raises ``BillingError`` on a request's 402 (it pauses on 402 only while polling a future) and fails at once on any
other 4xx. So a limit that frees itself (requests in flight, training clients held: a lapsed session is reaped) is
``RateLimited``, 429, which the SDK waits out; ``OverQuota`` (storage the tenant must free) is 402 on the Tinker routes,
429 with ``Retry-After`` on the job routes. Errors found while a Tinker request runs are not these: they resolve its
future with ``{"error", "category"}``, which the SDK raises as ``RequestFailedError``.
"""

from __future__ import annotations


class ServerError(Exception):
    status = 400

    def __init__(self, detail: str, retry_after: float | None = None):
        super().__init__(detail)
        self.detail, self.retry_after = detail, retry_after


class BadRequest(ServerError):
    status = 400


class Forbidden(ServerError):
    """The tenant may not write there (a name of its namespace that another MLflow user made first)."""

    status = 403


class NotFound(ServerError):
    """Unknown, or another tenant's: the same answer, so ids do not leak."""

    status = 404


class Conflict(ServerError):
    """The request does not fit the resource's state (a job already final, ...)."""

    status = 409


class Gone(ServerError):
    """The Tinker session finished or was reaped."""

    status = 410


class Invalid(ServerError):
    """Bad input: the message names the field and what was expected."""

    status = 422


class OverQuota(ServerError):
    """Over one of the tenant's limits: 429 with ``Retry-After`` on the job routes, 402 on the Tinker routes."""

    status = 429


class RateLimited(ServerError):
    """Too many of the tenant's requests in flight: back off and retry."""

    status = 429
