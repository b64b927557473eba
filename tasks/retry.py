"""Which failures are worth a Prefect retry: transient IO only (network, 5xx, throttling), never bad input; and
``io_task``, the one decorator of the steps that talk to a store."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

IO_RETRIES = 3
IO_BACKOFF = exponential_backoff(backoff_factor=2)
"""2 s, 4 s, 8 s (with jitter) between attempts."""

_TRANSIENT_NAMES = {
    "ConnectionError",
    "ConnectTimeout",
    "ReadTimeout",
    "Timeout",
    "TimeoutError",
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "ProtocolError",
    "RemoteDisconnected",
}


def _status_code(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return getattr(response, "status_code", None)  # requests / MLflow REST


def is_transient(exc: BaseException | None) -> bool:
    """Network errors and HTTP 429/5xx anywhere in the cause chain."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (ConnectionError, TimeoutError)) or type(exc).__name__ in _TRANSIENT_NAMES:
            return True
        code = _status_code(exc)
        if isinstance(code, int) and (code == 429 or code >= 500):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def retry_transient(task, task_run, state) -> bool:
    """Prefect ``retry_condition_fn``: retry only when the failure was transient IO."""
    return isinstance(state.data, BaseException) and is_transient(state.data)


def io_task(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """``@io_task``: a Prefect task that talks to a store (MLflow, S3, the registry): never cached, retried with
    backoff when the failure was transient IO (``retry_transient``), at once a failure otherwise."""
    defaults = {
        "cache_policy": NO_CACHE,
        "retries": IO_RETRIES,
        "retry_delay_seconds": IO_BACKOFF,
        "retry_condition_fn": retry_transient,
    }
    return task(fn, **{**defaults, **options}) if fn is not None else task(**{**defaults, **options})
