"""The HTTP answers the Tinker SDK acts on, as exceptions the service raises and the router turns into responses.

The SDK retries 408, 409, 429 and 5xx, re-submits on 410, pauses on 402 (a tenant over its quota, "billing") and
fails at once on any other 4xx. Errors found while a request runs are not these: they resolve its future with
``{"error", "category"}``, which the SDK raises as ``RequestFailedError``.
"""

from __future__ import annotations


class TinkerHTTPError(Exception):
    status = 400

    def __init__(self, detail: str, retry_after: float | None = None):
        super().__init__(detail)
        self.detail, self.retry_after = detail, retry_after


class BadRequest(TinkerHTTPError):
    status = 400


class NotFound(TinkerHTTPError):
    """Unknown, or another tenant's: the same answer, so ids do not leak."""

    status = 404


class Gone(TinkerHTTPError):
    """The session finished or was reaped."""

    status = 410


class OverQuota(TinkerHTTPError):
    """The tenant is over one of its limits: the SDK pauses and retries until it is not."""

    status = 402


class RateLimited(TinkerHTTPError):
    """Too many of the tenant's requests in flight: the SDK backs off and retries."""

    status = 429
