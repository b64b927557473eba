"""The Flower ServerApp: N rounds of train → aggregate → evaluate-on-every-site, checkpointed after each round,
tracked in one MLflow parent run, ending with the global policy in the MLflow registry.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from opentinker.federated import checkpoint, task, tracking
from opentinker.federated.client_app import from_record, to_record
from opentinker.federated.config import FedConfig
from opentinker.federated.rounds import RoundStats, evaluate_round, train_round
from opentinker.federated.strategies import make_strategy, restore_strategy_state, strategy_state
from opentinker.infra.files import atomic_write
from opentinker.infra.settings import get_settings

RESULT_FILE = "result.json"


@dataclass
class FederatedResult:
    """Outcome of a federated run, also written as result.json next to the checkpoint (for `flwr run` callers)."""

    status: str
    """'FINISHED' or 'FAILED'."""
    rounds: int
    """Last completed round."""
    history: list[dict] = field(default_factory=list)
    """Per-round metrics (round 0 is the initial model)."""
    mlflow_run_id: str = ""
    model_version: str = ""
    """Registered version of the final global model ('' when registration is off or the run failed)."""
    error: str = ""
    checkpoint_dir: str = ""


def checkpoint_dir(config: FedConfig) -> Path:
    if config.checkpoint_dir:
        return Path(config.checkpoint_dir)
    return get_settings().resolved_data_dir / "federated" / config.run_name / "server"


def _write_result(directory: Path, result: FederatedResult) -> None:
    atomic_write(directory / RESULT_FILE, json.dumps(asdict(result), indent=1))


def read_result(config: FedConfig) -> FederatedResult | None:
    path = checkpoint_dir(config) / RESULT_FILE
    return FederatedResult(**json.loads(path.read_text())) if path.exists() else None


def _history_entry(stats: RoundStats) -> dict:
    return {"round": stats.round, "sites": stats.sites, "failures": stats.failures, **stats.metrics()}


def run_federation(grid: Grid, config: FedConfig) -> FederatedResult:
    """Run (or resume) the federation on `grid`; raises on a failed round after recording it in result.json."""
    directory = checkpoint_dir(config)
    state = checkpoint.load(directory) if config.resume else None
    strategy = make_strategy(config)
    if state is None:
        initial = task.get_weights(task.new_trainer(config.env, task.default_variant(1), seed=config.seed))
        state = checkpoint.ServerState(round=-1, weights=initial)
    restore_strategy_state(strategy, state.strategy_state)
    state.mlflow_run_id = tracking.open_parent_run(config, state.mlflow_run_id)
    result = FederatedResult(
        "RUNNING", max(state.round, 0), state.history, state.mlflow_run_id, checkpoint_dir=str(directory)
    )
    arrays = to_record(state.weights)
    base = {"strategy": config.strategy, "env": config.env, "seed": config.seed, "eval-episodes": config.eval_episodes}
    train_config = ConfigRecord(
        {
            **base,
            "aggregation-interval": config.aggregation_interval,
            "local-steps": config.local_steps,
            "bc-epochs": config.bc_epochs,
            "bc-batch-size": config.bc_batch_size,
            "bc-learning-rate": config.bc_learning_rate,
            "bc-box-loss": config.bc_box_loss,
        }
    )
    try:
        if state.round < 0:  # score the initial model on every site: the baseline each round is compared with
            stats = RoundStats(round=0)
            started = time.monotonic()
            evaluate_round(grid, config, stats, arrays, ConfigRecord(base))
            stats.seconds = time.monotonic() - started
            _finish_round(directory, state, stats, arrays, strategy, config)
        for round_number in range(state.round + 1, config.num_server_rounds + 1):
            started = time.monotonic()
            arrays, stats = train_round(grid, strategy, config, round_number, arrays, train_config)
            evaluate_round(grid, config, stats, arrays, ConfigRecord(base))
            stats.seconds = time.monotonic() - started
            _finish_round(directory, state, stats, arrays, strategy, config)
        result.rounds, result.history = state.round, state.history
        if config.register_as:
            result.model_version = tracking.register_global_model(
                state.mlflow_run_id, config, state.weights, state.round
            )
        result.status = "FINISHED"
    except Exception as err:
        result.status, result.error = "FAILED", f"{type(err).__name__}: {err}"
        result.rounds, result.history = max(state.round, 0), state.history
        raise
    finally:
        tracking.finish_run(state.mlflow_run_id, "FINISHED" if result.status == "FINISHED" else "FAILED")
        _write_result(directory, result)
    return result


def _finish_round(
    directory: Path, state: checkpoint.ServerState, stats: RoundStats, arrays: ArrayRecord, strategy, config: FedConfig
) -> None:
    tracking.log_round(state.mlflow_run_id, stats)
    state.round = stats.round
    state.weights = from_record(arrays)
    state.history.append(_history_entry(stats))
    state.strategy_state = strategy_state(strategy)
    checkpoint.save(directory, state)


def build_server_app(config: FedConfig | None = None) -> ServerApp:
    """The ServerApp; `config` (simulation) replaces the run config Flower passes in a deployment."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run_federation(grid, config or FedConfig.from_run_config(dict(context.run_config)))

    return app


app = build_server_app()
