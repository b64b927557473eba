"""Flower's simulation engine (virtual sites on Ray): learning, MLflow tracking, registry, resume, bad replies."""

from __future__ import annotations

import mlflow
import numpy as np
import pytest
from fixtures.federated import small_fed_config
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.simulation import run_simulation

from opentinker.federated import checkpoint
from opentinker.federated.client_app import build_client_app, from_record, to_record
from opentinker.federated.config import SiteConfig
from opentinker.federated.rounds import CompletionFloorError
from opentinker.federated.server_app import build_server_app, checkpoint_dir
from opentinker.federated.simulation import simulate

pytestmark = pytest.mark.slow  # starts real services or trains through a flow


def test_fedavg_improves_every_site_then_resumes_from_checkpoint(ray_session):
    config = small_fed_config(run_name="sim-fedavg", register_as="fed-sim")
    result = simulate(config)
    assert result.status == "FINISHED" and result.rounds == 2
    first, last = result.history[0], result.history[-1]
    for site in range(3):
        assert last[f"return/site-{site}"] > first[f"return/site-{site}"], (site, first, last)
    assert all(entry["round/bytes_sent"] > 0 for entry in result.history)
    assert all(entry["round/bytes_received"] > 0 for entry in result.history[1:])

    client = mlflow.MlflowClient()
    assert [m.step for m in client.get_metric_history(result.mlflow_run_id, "return/site-2")] == [0, 1, 2]
    assert client.get_run(result.mlflow_run_id).data.params["fed.strategy"] == "fedavg"
    assert str(client.get_model_version_by_alias("fed-sim", "federated").version) == result.model_version

    # A restarted server continues from its last checkpointed round instead of starting over.
    saved = checkpoint.load(checkpoint_dir(config))
    resumed = simulate(small_fed_config(run_name="sim-fedavg", register_as="fed-sim", num_server_rounds=3))
    assert [entry["round"] for entry in resumed.history] == [0, 1, 2, 3]
    assert resumed.history[:3] == saved.history and resumed.mlflow_run_id == result.mlflow_run_id
    assert [m.step for m in client.get_metric_history(result.mlflow_run_id, "return/site-0")] == [0, 1, 2, 3]


def _client_app_with_a_truncated_site(bad_site: int) -> ClientApp:
    """Real sites, except `bad_site` returns a policy head of the wrong width (a site running another model)."""
    real = build_client_app([SiteConfig(site_id=i) for i in range(3)])
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        reply = real(msg, context)
        if context.node_config["partition-id"] == bad_site:
            weights = from_record(reply.content["arrays"])
            weights["actor.4.weight"] = weights["actor.4.weight"][:, :32]
            reply.content["arrays"] = to_record(weights)
        return reply

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return real(msg, context)

    return app


def test_mismatched_reply_is_rejected_and_the_completion_floor_fails_loudly(ray_session):
    config = small_fed_config(
        run_name="sim-floor", strategy="fedprox", num_server_rounds=1, min_completion_rate=1.0, register_as=""
    )
    with pytest.raises(CompletionFloorError) as failure:
        run_simulation(
            server_app=build_server_app(config),
            client_app=_client_app_with_a_truncated_site(1),
            num_supernodes=3,
            backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
        )
    message = str(failure.value)
    assert "round 1: 2 valid replies from 3 sites" in message and "needs 3" in message
    assert (
        "rejected" in message
        and "site 1" in message
        and "'actor.4.weight' has shape (2, 32), expected (2, 64)" in message
    )
    state = checkpoint.load(checkpoint_dir(config))
    assert state.round == 0  # the failed round left the last good checkpoint untouched
    assert np.isfinite(state.history[0]["return/mean"])
