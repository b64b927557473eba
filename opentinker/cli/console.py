"""The CLI's one console, its error decorator, and what a flow run needs around it in a terminal.

Heavy packages are imported inside functions so ``opentinker --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Annotated, ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

console = Console(soft_wrap=True)  # long paths and URIs stay on one line (copy-pasteable)

Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Show Prefect/MLflow logs and full tracebacks.")]

P = ParamSpec("P")
R = TypeVar("R")


def _known_errors() -> tuple[type[BaseException], ...]:
    """The project's bad-input (and clearly explained start-up) errors: their message is the whole story."""
    from pydantic import ValidationError

    from opentinker.agents.bc import DatasetError
    from opentinker.envs.errors import EnvSpecError, EnvValidationError
    from opentinker.federated.config import FederatedConfigError
    from opentinker.federated.deploy import FederationError
    from opentinker.flows.params import ConfigError
    from opentinker.infra.cluster import ClusterError
    from opentinker.infra.processes import ServiceError
    from opentinker.infra.s3 import S3Error
    from opentinker.infra.stack import StackError
    from opentinker.server.client import NotConnected, ServerError
    from opentinker.server.keys import KeyRequestError
    from opentinker.server.packaging import UploadError
    from opentinker.server.tenants import TenantError
    from opentinker.serving.auth import ApiKeyError
    from opentinker.serving.deploy import DeploymentError
    from opentinker.tracking.registry import PolicyStoreError

    return (
        ConfigError,
        ValidationError,  # pydantic models and settings (OPENTINKER_* variables)
        EnvSpecError,
        EnvValidationError,
        ApiKeyError,
        PolicyStoreError,
        DatasetError,
        FederatedConfigError,
        FederationError,
        DeploymentError,
        StackError,
        ClusterError,
        ServiceError,
        S3Error,  # unreachable storage or refused credentials
        KeyRequestError,
        TenantError,
        ServerError,  # the server's answer names the field or the limit
        NotConnected,
        UploadError,
    )


def _describe(exc: BaseException) -> str:
    from pydantic import ValidationError

    from opentinker.flows.params import describe_errors

    if isinstance(exc, ValidationError):
        return f"invalid {exc.title}:\n{describe_errors(exc)}"
    return str(exc)


def cli_errors(command: Callable[P, R]) -> Callable[P, R]:
    """Known bad input: one red ``error:`` line (or a field list) and exit code 1. Anything else: the traceback.

    A command with ``--verbose`` re-raises known errors too, for their traceback.
    """

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort):  # an exit status, not an error (and no need to import every error type)
            raise
        except Exception as exc:
            if kwargs.get("verbose") or not isinstance(exc, _known_errors()):
                raise
            console.print(f"[bold red]error:[/] {escape(_describe(exc))}")
            raise typer.Exit(1) from None

    return wrapper


@contextlib.contextmanager
def training_progress(total_steps: int, label: str) -> Iterator[None]:
    """A rich bar fed by the training stage through ``opentinker.tracking.progress``."""
    from opentinker.server.watch import steps_bar
    from opentinker.tracking import progress

    with steps_bar(console, time_left=True) as bar:
        task_id = bar.add_task(label, total=total_steps, info="starting Prefect, Ray and MLflow…")

        def listener(step: int, total: int, metrics: dict[str, float]) -> None:
            info = []
            for key, fmt in (("charts/episodic_return_mean", "return {:.1f}"), ("charts/sps", "{:.0f} steps/s")):
                if key in metrics:
                    info.append(fmt.format(metrics[key]))
            bar.update(task_id, completed=min(step, total), total=total, info=" · ".join(info))

        progress.add_listener(listener)
        try:
            yield
        finally:
            progress.remove_listener(listener)


def print_ui_hints() -> None:
    """How to look at what just happened."""
    from opentinker.infra.settings import get_settings
    from opentinker.tracking.runs import ui_url

    settings = get_settings()
    console.print(f"MLflow UI:  {ui_url('experiments')}")
    prefect_url = settings.prefect_api_url or os.environ.get("PREFECT_API_URL", "")
    if prefect_url:
        from opentinker.infra.local_prefect import running_local_prefect

        running = running_local_prefect(settings)
        local = running is not None and prefect_url == f"{running.url}/api"
        hint = "  (this data dir's server; `opentinker down` stops it)" if local else ""
        console.print(f"Prefect UI: {prefect_url.removesuffix('/api')}/runs{hint}")
    if not (prefect_url and settings.tracking_uri.startswith("http")):
        console.print(
            "Full stack with both UIs and S3:  opentinker stack up  (then `opentinker stack status` for URLs)"
        )
