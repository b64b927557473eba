"""Reports and artifacts: render plots/config/model card, then ship them to the MLflow run and S3.

MLflow stores artifacts under the experiment's location (the data dir, or S3 when configured).
With S3 configured the checkpoint is also mirrored with boto3 to ``s3://BUCKET/[PREFIX]checkpoints/RUN_NAME/``
so that another machine can resume from it. Transient IO is retried with exponential backoff.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from opentinker.agents.evaluation import EvalResult
from opentinker.infra.settings import get_settings
from opentinker.tasks.retry import io_task
from opentinker.tasks.types import TrainOutcome
from opentinker.tracking.model_card import render_model_card
from opentinker.tracking.plot_process import PlotProcess, draw_plots
from opentinker.tracking.registry import ModelRef
from opentinker.tracking.runs import configure_mlflow, load_history

Artifact = tuple[str, str]
"""(artifact sub-directory, local path)."""


@io_task
def check_storage() -> str:
    """Fail fast, before any training or registration, when configured S3 is unreachable or refuses us."""
    settings = get_settings()
    if not settings.s3_endpoint_url:
        return str(settings.resolved_data_dir / "artifacts")
    from opentinker.infra.s3 import ensure_bucket

    return f"s3://{ensure_bucket()}"


@task(cache_policy=NO_CACHE)
def render_reports(
    params: dict[str, Any],
    trained: TrainOutcome,
    evaluation: EvalResult | None,
    model: ModelRef | None,
    drawing: PlotProcess | None = None,
) -> list[Artifact]:
    """Learning curve, dashboard-metric and evaluation plots (PNG), the config (JSON) and the model card (markdown).
    ``drawing``: the plots already asked of a plotting process (``PlotProcess.draw``), collected here; else drawn
    here."""
    out = reports_dir(trained)
    config = out / "config.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(params, indent=2, sort_keys=True, default=str))
    card = out / "model_card.md"
    card.write_text(
        render_model_card(
            params,
            dataclasses.asdict(evaluation) if evaluation else None,
            model.model_dump() if model else None,
            trained.run_id,
            trained.global_step,
        )
    )
    if drawing is not None:
        drawn = drawing.paths()
    else:
        returns = evaluation.returns if evaluation else None
        eval_mean = evaluation.mean if evaluation else None
        history = load_history(Path(trained.history_path))
        drawn = draw_plots(history, out, eval_mean, returns, evaluation.seed if evaluation else None)
    return [*(("plots", str(path)) for path in drawn), ("config", str(config)), ("", str(card))]


def reports_dir(trained: TrainOutcome) -> Path:
    """Where a run's reports are written before upload."""
    return Path(trained.history_path).parent / "reports" / trained.run_id


@io_task
def upload_artifacts(run_id: str, artifacts: list[Artifact], checkpoint_path: str, run_name: str) -> list[str]:
    """Log every artifact and the checkpoint to the MLflow run; mirror the checkpoint to S3 when configured."""
    import mlflow

    configure_mlflow()
    client = mlflow.MlflowClient()
    for artifact_dir, path in [*artifacts, ("checkpoint", checkpoint_path)]:
        client.log_artifact(run_id, path, artifact_path=artifact_dir or None)
    uris = [f"runs:/{run_id}/{d + '/' if d else ''}{Path(p).name}" for d, p in artifacts]
    uris.append(f"runs:/{run_id}/checkpoint/{Path(checkpoint_path).name}")
    if get_settings().s3_endpoint_url:
        uris.append(_mirror_checkpoint(checkpoint_path, run_name))
    return uris


def _mirror_checkpoint(checkpoint_path: str, run_name: str) -> str:
    from opentinker.infra.s3 import ensure_bucket, s3_client

    settings = get_settings()
    # Under a prefix the identity is a tenant's, which reaches its prefix only: the bucket is the operator's to make.
    bucket = settings.s3_bucket if settings.s3_prefix else ensure_bucket()
    key = f"{settings.s3_prefix}checkpoints/{run_name}/{Path(checkpoint_path).name}"
    s3_client().upload_file(checkpoint_path, bucket, key)
    return f"s3://{bucket}/{key}"
