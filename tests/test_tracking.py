"""Tracking edge without the engine: the metrics callback against a real MLflow store, plots, model card, gate rule."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import time

import mlflow
import pytest

from opentinker.tasks.register import decide
from opentinker.tasks.retry import is_transient
from opentinker.tracking import runs as tracking
from opentinker.tracking.model_card import render_model_card
from opentinker.tracking.plots import evaluation_returns, learning_curve, perf_metrics
from opentinker.tracking.registry import slug


@pytest.fixture()
def run_id():
    experiment_id = tracking.ensure_experiment("test-tracking")
    run = mlflow.MlflowClient().create_run(experiment_id)
    yield run.info.run_id
    mlflow.MlflowClient().set_terminated(run.info.run_id)


def _png_size(path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_metrics_logger_batches_to_mlflow_against_global_step(run_id, monkeypatch):
    monkeypatch.setattr(tracking, "FLUSH_EVERY_S", 3600.0)  # nothing reaches MLflow until flush()
    seen = []
    logger = tracking.MetricsLogger(run_id, on_iteration=lambda step, row: seen.append(step))
    for i in range(1, 6):
        logger({"charts/episodic_return": 10.0 * i, "losses/value_loss": 1.0 / i, "charts/bad": float("nan")}, 512 * i)
    client = mlflow.MlflowClient()
    assert client.get_metric_history(run_id, "charts/episodic_return") == []
    logger.flush()
    history = client.get_metric_history(run_id, "charts/episodic_return")
    assert [(m.step, m.value) for m in history] == [(512 * i, 10.0 * i) for i in range(1, 6)]
    assert seen == [512 * i for i in range(1, 6)]
    assert client.get_metric_history(run_id, "charts/bad") == []  # non-finite values are dropped, not logged
    cpu = client.get_metric_history(run_id, "perf/cpu_percent")
    assert len(cpu) == 5 and all(0.0 <= m.value <= 100.0 * 64 for m in cpu)
    assert client.get_metric_history(run_id, "perf/memory_rss_mb")[0].value > 10


def test_metrics_logger_sends_a_charts_worth_of_rows_and_keeps_sparse_metrics(run_id, monkeypatch):
    monkeypatch.setattr(tracking, "MAX_ROWS", 10)
    logger = tracking.MetricsLogger(run_id, total_steps=100 * 256)
    for i in range(1, 101):  # 100 iterations of 256 env steps; an episode ends every 7th iteration only
        logger({"charts/sps": float(i), **({"charts/episodic_return": float(i)} if i % 7 == 0 else {})}, 256 * i)
    logger.flush()
    assert len(logger.history) == 100  # the history (plots, history.jsonl) keeps every iteration
    client = mlflow.MlflowClient()
    sps = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "charts/sps"))
    assert 10 <= len(sps) <= 11 and sps[-1] == (25_600, 100.0)  # one row per 2,560 steps, and the last iteration
    episodic = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "charts/episodic_return"))
    values = [v for _, v in episodic]
    assert all(v % 7 == 0 for v in values) and values == sorted(set(values))
    assert len(episodic) >= 9 and episodic[-1][1] == 98.0  # the latest value at each row: sparse metrics never vanish


def test_history_round_trip_and_plots(tmp_path):
    history = [
        {
            "step": 100.0 * i,
            "charts/episodic_return": float(i * i),
            "charts/episodic_return_min": float(i),
            "charts/episodic_return_max": float(2 * i * i),
            "perf/cpu_percent": 50.0,
            "perf/rollout_efficiency": 0.8,
        }
        for i in range(1, 20)
    ]
    path = tmp_path / "history.jsonl"
    logger = object.__new__(tracking.MetricsLogger)
    logger.history = history
    logger.save_history(path)
    assert tracking.load_history(path) == history
    curve = learning_curve(history, tmp_path / "curve.png", eval_mean=300.0)
    system = perf_metrics(history, tmp_path / "system.png")
    assert _png_size(curve) == (800, 450)
    width, height = _png_size(system)
    assert width == 1200 and height > 0
    assert curve.stat().st_size > 10_000  # axes, a curve and a band were drawn, not an empty canvas
    episodes = evaluation_returns([500.0, 120.0, 480.0, 500.0], 10_000, tmp_path / "evaluation.png")
    assert _png_size(episodes) == (800, 450) and episodes.stat().st_size > 10_000


def test_plots_drawn_in_their_own_process_and_its_failure_reported(tmp_path):
    """The flow's plots come from a plotting child (``PlotProcess``) while it registers: the same three PNGs as drawn
    in-process; a failure there comes back with its traceback; a child asked nothing (the flow failed first) exits."""
    from types import SimpleNamespace

    from opentinker.tracking.plot_process import PlotProcess

    history = tmp_path / "history.jsonl"
    rows = [{"step": 100.0 * i, "charts/episodic_return": float(i), "perf/cpu_percent": 50.0} for i in range(1, 9)]
    history.write_text("".join(f"{json.dumps(row)}\n" for row in rows))
    with PlotProcess() as drawing:
        drawing.draw(history, tmp_path / "out", SimpleNamespace(mean=4.5, returns=[4.0, 5.0], seed=10_000))
        paths = drawing.paths()
    assert [os.path.basename(path) for path in paths] == [
        "learning_curve.png",
        "perf_metrics.png",
        "evaluation_returns.png",
    ]
    assert _png_size(tmp_path / "out" / "learning_curve.png") == (800, 450)
    with PlotProcess() as drawing:
        (tmp_path / "taken").write_text("a file where the reports folder would go")
        drawing.draw(history, tmp_path / "taken" / "out", None)
        with pytest.raises(RuntimeError, match=r"plotting failed in its process \(pid \d+\)") as failed:
            drawing.paths()
    assert "Traceback" in str(failed.value) and "taken" in str(failed.value)
    with PlotProcess() as drawing:
        pass
    assert drawing._process.returncode == 0


def test_mlflow_system_metrics_are_logged_for_the_run_until_stopped(run_id, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.5")
    tracking.start_system_metrics(run_id)
    client = mlflow.MlflowClient()
    deadline = time.monotonic() + 60
    while "system/cpu_utilization_percentage" not in client.get_run(run_id).data.metrics:
        assert time.monotonic() < deadline, "no system/ metrics within 60 s"
        time.sleep(0.2)
    assert "system/system_memory_usage_megabytes" in client.get_run(run_id).data.metrics
    assert not any(key.startswith("perf/") for key in client.get_run(run_id).data.metrics)  # no clash with ours
    monitor = next(t for t in threading.enumerate() if t.name == "SystemMetricsMonitor")
    tracking.stop_system_metrics(run_id)
    assert not monitor.is_alive()


def test_a_run_shorter_than_the_sampling_interval_still_gets_a_system_sample(run_id):
    """The monitor samples every 2 s and drops an interval that a stop cuts short; the stop logs that interval's
    samples and one more, so even an instant run's System metrics tab is never empty."""
    tracking.start_system_metrics(run_id)
    tracking.stop_system_metrics(run_id)  # well inside the first interval
    metrics = mlflow.MlflowClient().get_run(run_id).data.metrics
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(metrics)
    history = mlflow.MlflowClient().get_metric_history(run_id, "system/cpu_utilization_percentage")
    assert [m.step for m in history] == [0]


def test_model_card_names_env_algorithm_eval_commit_and_versions():
    card = render_model_card(
        {"env_id": "CartPole-v1", "algorithm": "ppo", "seed": 3, "steps": 1000},
        {"mean": 481.5, "std": 3.25, "returns": [480.0, 483.0], "seed": 10_000},
        {"name": "opentinker-cartpole-v1", "version": "4", "aliases": ["candidate"], "decision": "promoted: x"},
        run_id="abc123",
        global_step=1024,
    )
    assert "CartPole-v1" in card and "PPO" in card
    assert "481.50" in card and "± 3.25" in card
    assert tracking.git_commit() in card and "unknown" != tracking.git_commit()
    assert "- torch " in card and "- mlflow " in card
    assert "version 4" in card and "promoted: x" in card


@pytest.mark.parametrize(
    ("candidate", "champion", "threshold", "promote"),
    [
        (500.0, None, 475.0, True),
        (400.0, None, 475.0, False),
        (500.0, 500.0, 475.0, False),
        (490.0, 500.0, 475.0, False),
        (500.0, 490.0, 475.0, True),
        (470.0, 100.0, 475.0, False),
    ],
)
def test_promotion_rule(candidate, champion, threshold, promote):
    assert decide(candidate, champion, threshold)[0] is promote


def test_only_transient_io_is_retried():
    from botocore.exceptions import ClientError, EndpointConnectionError

    assert is_transient(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(
        ClientError({"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}, "put")
    )
    assert not is_transient(
        ClientError({"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}, "put")
    )
    assert not is_transient(ValueError("bad input"))
    try:
        try:
            raise ConnectionResetError("reset")
        except ConnectionResetError as inner:
            raise RuntimeError("upload failed") from inner
    except RuntimeError as outer:
        assert is_transient(outer)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("CartPole-v1", "cartpole-v1"),  # the registered names existing runs carry stay the same
        ("ALE/Pong-v5", "ale-pong-v5"),
        ("my__model  name", "my-model-name"),
        ("--Pendulum_v1--", "pendulum-v1"),
        ("café", "caf"),
    ],
)
def test_one_slug_for_model_run_and_bento_names(text, expected):
    from opentinker.flows.params import TrainParams

    assert slug(text) == expected
    assert TrainParams(env_id="CartPole-v1", steps=64).resolved_model_name == "opentinker-cartpole-v1"


def test_importing_the_library_leaves_the_environment_alone():
    """BentoML and Flower processes import tasks/, serving/ and federated/: none may change os.environ on import."""
    code = (
        "import os; before = dict(os.environ)\n"
        "import opentinker.tasks, opentinker.tasks.register, opentinker.flows.train, opentinker.tracking.registry\n"
        "import opentinker.serving.policy_service, opentinker.federated.server_app\n"
        "print(sorted(k for k in set(os.environ) | set(before) if k.startswith(('PREFECT_', 'MLFLOW_', 'AWS_', "
        "'OPENTINKER_')) and os.environ.get(k) != before.get(k)))\n"
        "from opentinker.tasks import prefect_defaults; prefect_defaults()\n"
        "from prefect.settings import get_current_settings\n"
        "print(get_current_settings().server.ephemeral.startup_timeout_seconds)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_SERVER_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "180"], out.stdout  # nothing on import; the explicit call applies
