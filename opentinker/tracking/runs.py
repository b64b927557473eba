"""MLflow edge: where runs go (the one setup function, from settings), and the per-iteration metrics callback.

The RL core never imports MLflow; it calls ``callback(metrics, step)`` once per iteration.
``MetricsLogger`` is that callback: it adds system metrics (CPU %, RSS, GPU via NVML), keeps
the history for the plots and flushes metrics to MLflow in batches so that tracking costs
milliseconds per iteration, not a round-trip each.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from opentinker.infra.settings import get_settings
from opentinker.tracking import progress

FLUSH_EVERY_S = 5.0
"""Seconds between batched writes to MLflow; the last batch is flushed when training ends."""
SAMPLE_EVERY_S = 1.0
"""Seconds between two reads of the system figures (``perf/``): psutil reads /proc, an iteration takes milliseconds."""

MAX_ROWS = 500
"""Rows per metric sent to MLflow over a run's horizon (a chart's worth; the history file keeps every iteration).
Writing each of a fast run's thousands of iterations to MLflow's SQLite store cost more than the training itself."""

_MLFLOW_BATCH_LIMIT = 1000

EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
"""The tag MLflow 3's UI reads to open an experiment in its machine-learning views (runs, charts, models)
rather than its GenAI views (traces, latency, tokens)."""
UI_QUERY = "?workflowType=machine_learning"
"""The same choice for a link: the UI's workflow switch, read from the URL of the page it opens."""


def configure_mlflow():
    """The one MLflow setup: point MLflow at the configured store (S3 credentials from settings when set).

    Read-only: it creates nothing, so a serving process can call it; ``ensure_experiment`` creates. Returns ``mlflow``.
    """
    import mlflow

    settings = get_settings()
    if settings.s3_endpoint_url:
        export_s3_environment()
    mlflow.set_tracking_uri(settings.tracking_uri)
    return mlflow


@contextlib.contextmanager
def mlflow_at(uri: str) -> Iterator[Any]:
    """``mlflow`` with its process-wide tracking and registry URIs at ``uri`` for the block, then exactly as before: a
    registry that was unset stays unset (it follows the tracking URI). ``mlflow.set_registry_uri`` cannot restore
    that: it pins the URI, and exports it as ``MLFLOW_REGISTRY_URI`` to every later subprocess."""
    import mlflow
    from mlflow.tracking._model_registry import utils as registry

    before = mlflow.get_tracking_uri(), registry._registry_uri, os.environ.get("MLFLOW_REGISTRY_URI")
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        yield mlflow
    finally:
        mlflow.set_tracking_uri(before[0])
        registry._registry_uri = before[1]
        if before[2] is None:
            os.environ.pop("MLFLOW_REGISTRY_URI", None)
        else:
            os.environ["MLFLOW_REGISTRY_URI"] = before[2]


def ensure_experiment(experiment: str | None = None) -> str:
    """``configure_mlflow`` then the experiment's id, created on demand (default: ``settings.mlflow_experiment``).

    Against a tracking server the server decides where artifacts go (the stack's server proxies
    them to S3, so clients need no S3 credentials). Without a server a new experiment stores
    artifacts under ``settings.artifact_root``: the data dir, or S3 when configured (via boto3).
    """
    settings = get_settings()
    client = configure_mlflow().MlflowClient()
    name = experiment or settings.mlflow_experiment
    found = client.get_experiment_by_name(name)
    if found is not None:
        if EXPERIMENT_KIND[0] not in found.tags:
            client.set_experiment_tag(found.experiment_id, *EXPERIMENT_KIND)
        return found.experiment_id
    location = None if settings.tracking_uri.startswith("http") else settings.artifact_root
    return client.create_experiment(name, artifact_location=location, tags=dict([EXPERIMENT_KIND]))


_SYSTEM_MONITORS: dict[str, Any] = {}
"""MLflow system-metrics monitors started in this process, by run id (``start_system_metrics``)."""


def start_system_metrics(run_id: str) -> None:
    """MLflow's own system metrics (``system/``: CPU, memory, disk, network, GPU) for the run, against wall-clock
    time on its "System metrics" tab, every 2 s; ours (``perf/``) stay against the env step. MLflow drops the samples
    of an interval that a stop cuts short, so its 10 s default left a run shorter than that with no system metrics."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = _SYSTEM_MONITORS[run_id] = SystemMetricsMonitor(
        run_id, sampling_interval=2, tracking_uri=get_settings().tracking_uri
    )
    monitor.start()


def stop_system_metrics(run_id: str) -> None:
    """Stop the run's monitor (if this process started it) and log its final sample: the samples of the interval
    the stop cuts short, and one taken now, so every tracked run has at least one (a run shorter than the 2 s
    interval would otherwise show an empty System metrics tab). One started elsewhere stops by itself once the run
    has ended, losing only that last batch."""
    monitor = _SYSTEM_MONITORS.pop(run_id, None)
    if monitor is None:
        return
    monitor.finish()  # stops its thread (which drops the unfinished interval's samples) and flushes its batch
    monitor.collect_metrics()
    monitor.publish_metrics(monitor.aggregate_metrics())
    monitor.mlflow_logger.flush()


def export_s3_environment() -> None:
    """MLflow's S3 artifact store reads boto3's environment; derive it from settings."""
    settings = get_settings()
    os.environ["MLFLOW_S3_ENDPOINT_URL"] = settings.s3_endpoint_url
    os.environ.setdefault("AWS_DEFAULT_REGION", settings.s3_region)
    if settings.s3_access_key:
        os.environ["AWS_ACCESS_KEY_ID"] = settings.s3_access_key
        os.environ["AWS_SECRET_ACCESS_KEY"] = settings.s3_secret_key


def run_url(run_id: str, experiment_id: str) -> str:
    """A browsable URL for a run when tracking goes to a server, else the ``mlflow ui`` command to open it."""
    return ui_url(f"experiments/{experiment_id}/runs/{run_id}")


def ui_url(page: str) -> str:
    """A page of the MLflow UI (``experiments/1``, ``models/NAME``) in its machine-learning views."""
    uri = get_settings().tracking_uri
    if uri.startswith("http"):
        return f"{uri.rstrip('/')}/#/{page}{UI_QUERY}"
    return f"mlflow ui --backend-store-uri {uri}  (then open http://127.0.0.1:5000/#/{page}{UI_QUERY})"


def flatten(params: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config → MLflow's flat string params (``ppo.learning_rate``); unset (None) fields are left out."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, prefix=f"{name}."))
        elif value is not None:
            flat[name] = str(value)[:6000]
    return flat


class SystemSampler:
    """Device utilisation: CPU % and RSS via psutil, GPU % and memory via NVML when a GPU is present."""

    def __init__(self, pid: int | None = None) -> None:
        """``pid``: the process whose memory is reported (the learner's; this one by default)."""
        import psutil

        self._process = psutil.Process(pid)
        self._psutil = psutil
        psutil.cpu_percent(interval=None)  # primes the counter: the next call measures since now
        self._gpus = _nvml_handles()
        self._sampled_at = -SAMPLE_EVERY_S
        self._values: dict[str, float] = {}

    def sample(self) -> dict[str, float]:
        """The latest figures, read at most once every ``SAMPLE_EVERY_S`` (an iteration can take milliseconds)."""
        if time.monotonic() - self._sampled_at < SAMPLE_EVERY_S:
            return self._values
        self._sampled_at = time.monotonic()
        values = {
            "perf/cpu_percent": self._psutil.cpu_percent(interval=None),
            "perf/memory_rss_mb": self._process.memory_info().rss / 2**20,
        }
        if self._gpus:
            import pynvml

            util = [pynvml.nvmlDeviceGetUtilizationRates(h) for h in self._gpus]
            mem = [pynvml.nvmlDeviceGetMemoryInfo(h) for h in self._gpus]
            values["perf/gpu_percent"] = sum(u.gpu for u in util) / len(util)
            values["perf/gpu_memory_mb"] = sum(m.used for m in mem) / 2**20
        self._values = values
        return values


def _nvml_handles() -> list[Any]:
    try:
        import pynvml

        pynvml.nvmlInit()
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # no driver / no GPU: CPU metrics only
        return []


class MetricsLogger:
    """The RL core's ``callback(metrics, step)``: history for plots, batched MLflow writes, progress.

    Every iteration goes to the history; MLflow gets a row each ``total_steps / MAX_ROWS`` env steps (every
    iteration of a shorter run), holding the latest value of each metric reported since the previous row, so a
    metric only some iterations report (episode returns) is never dropped from the charts."""

    def __init__(
        self,
        run_id: str | None,
        on_iteration: Callable[[int, dict[str, float]], None] | None = None,
        total_steps: int | None = None,
        learner_pid: int | None = None,
        system: bool = True,
    ) -> None:
        """``run_id`` None: metrics wait in memory until it is set (training started before its MLflow run).
        MLflow is imported at the first write, not here: a run started early must not wait seconds for it.
        ``learner_pid``: the training process when it is not this one (its memory is what ``perf/`` reports);
        ``system`` False: the metrics come from elsewhere with their own ``perf/`` (a sandboxed job's)."""
        self.run_id = run_id
        self.history: list[dict[str, float]] = []
        self._client: Any = None
        self._sampler = SystemSampler(learner_pid) if system else None
        self._pending: list[Any] = []
        self._unsent: dict[str, float] = {}
        self._row_every = (total_steps or 0) / MAX_ROWS
        self._next_row = 0.0
        self._last_flush = time.monotonic()
        self._on_iteration = on_iteration

    @classmethod
    def with_progress(
        cls, run_id: str | None, total_steps: int, learner_pid: int | None = None, system: bool = True
    ) -> MetricsLogger:
        """The training stages' logger: it also reports each iteration to the progress listeners (the CLI's bar)."""
        return cls(
            run_id,
            on_iteration=lambda step, row: progress.report(step, total_steps, row),
            total_steps=total_steps,
            learner_pid=learner_pid,
            system=system,
        )

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        row = {k: float(v) for k, v in metrics.items() if _finite(v)}
        if self._sampler is not None:
            row.update(self._sampler.sample())
        self.history.append({"step": float(step), **row})
        self._unsent.update(row)
        if step >= self._next_row:
            self._next_row = step + self._row_every
            self._queue_row()
        if time.monotonic() - self._last_flush >= FLUSH_EVERY_S:
            self._write()
        if self._on_iteration is not None:
            self._on_iteration(step, row)

    def _queue_row(self) -> None:
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        step = int(self.history[-1]["step"])
        self._pending.extend(Metric(k, v, timestamp, step) for k, v in self._unsent.items())
        self._unsent = {}

    def flush(self) -> None:
        """Send everything reported so far (the last iteration's row included)."""
        if self._unsent:
            self._queue_row()
        self._write()

    def _write(self) -> None:
        if self.run_id is None:
            return
        if self._client is None:
            import mlflow

            self._client = mlflow.MlflowClient(get_settings().tracking_uri)
        pending, self._pending = self._pending, []
        for start in range(0, len(pending), _MLFLOW_BATCH_LIMIT):
            self._client.log_batch(self.run_id, metrics=pending[start : start + _MLFLOW_BATCH_LIMIT])
        self._last_flush = time.monotonic()

    def save_history(self, path: Path) -> Path:
        """JSON lines, one per iteration; appended so a resumed run's plots show the whole curve."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as handle:
            for row in self.history:
                handle.write(json.dumps(row) + "\n")
        return path


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def load_history(path: Path) -> list[dict[str, float]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def git_commit() -> str:
    """The commit of the OpenTinker checkout this code runs from ('unknown' outside git)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def package_versions() -> dict[str, str]:
    versions = {}
    for name in ("opentinker", "torch", "numpy", "gymnasium", "ray", "prefect", "mlflow", "bentoml"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def log_capacity_wait(client: Any, run_id: str, seconds: float) -> None:
    """Add ``seconds`` to the run's ``perf/capacity_wait_s``: its latest value is the run's total wait for capacity
    (each placement of rollout actors, e.g. the probe's and training's, is one step)."""
    history = client.get_metric_history(run_id, "perf/capacity_wait_s")
    total = (max(history, key=lambda metric: metric.step).value if history else 0.0) + seconds
    client.log_metric(run_id, "perf/capacity_wait_s", total, step=len(history))
