"""Prefect tasks: one logical, retriable step each (probe, train, evaluate, register, upload, federated steps).

Importing this package changes nothing; whoever starts a flow calls ``prefect_defaults()`` first (the CLI, the test
session, a bench), so BentoML and Flower processes that import the library keep their own environment.
"""

import logging
import os
import warnings

_NOISY_LOGGERS = ("mlflow", "ray", "alembic", "httpx", "urllib3", "botocore", "bentoml", "filelock")


def prefect_defaults() -> None:
    """Safe Prefect defaults for this process, unless already set; call it before a flow starts.

    The ephemeral API server needs far longer than Prefect's 20 s default to start on a busy 2-core machine; no
    analytics (and no telemetry errors offline); Prefect 3.7 keeps results (and cache records) in ~/.prefect/storage
    even when PREFECT_HOME points elsewhere. Prefect reads its settings once at import, so they are re-read here.
    """
    import sys

    home = os.path.expanduser(os.environ.get("PREFECT_HOME", "~/.prefect"))
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", os.path.join(home, "storage"))
    if "prefect.context" in sys.modules:
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()


def prepare_prefect(verbose: bool = False) -> None:
    """A terminal's flow (the CLI's, and the warm flow process it forks from), before Prefect is imported: the API
    URL from settings, ``prefect_defaults()``, quiet logs.

    Quiet means the terminal: flow and task logs still reach the Prefect server at INFO (its Logs tab), only
    Prefect's console handler is raised to WARNING. MLflow's own "View run" lines give way to the CLI's links.
    """
    from opentinker.infra.settings import get_settings

    api_url = get_settings().prefect_api_url
    if api_url:
        os.environ["PREFECT_API_URL"] = api_url
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # silences a Ray FutureWarning
        warnings.filterwarnings("ignore")
        for name in _NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    prefect_defaults()
