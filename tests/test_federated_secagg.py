"""SecAgg+ on Flower's simulation engine: the server gets the same sample-weighted average as plain FedAvg without
seeing any one site's weights (deterministic behaviour-cloning sites make the two runs comparable)."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.federated import expert_sites, small_fed_config

from opentinker.federated import checkpoint, task
from opentinker.federated.config import FederatedConfigError
from opentinker.federated.server_app import checkpoint_dir
from opentinker.federated.simulation import simulate

pytestmark = pytest.mark.slow  # starts real services or trains through a flow


def test_secure_aggregation_config_errors():
    with pytest.raises(FederatedConfigError, match="secure-aggregation needs strategy fedavg or fedprox"):
        small_fed_config(secure_aggregation=True, strategy="fedadam")
    with pytest.raises(FederatedConfigError, match="num-sites >= 2"):
        small_fed_config(secure_aggregation=True, num_sites=1)


def test_secagg_plus_round_equals_plain_fedavg(ray_session, tmp_path):
    sites = expert_sites(tmp_path, episodes=(1, 2, 3), seed=20)
    sizes = [len(np.load(site.dataset)["obs"]) for site in sites]
    runs = {}
    for secure in (False, True):
        config = small_fed_config(
            run_name=f"secagg-{secure}",
            num_server_rounds=1,
            register_as="",
            eval_episodes=1,
            secure_aggregation=secure,
            secagg_max_weight=max(sizes),
        )
        result = simulate(config, sites)
        assert result.status == "FINISHED", result.error
        runs[secure] = (result, checkpoint.load(checkpoint_dir(config)).weights)
    (plain, plain_weights), (masked, masked_weights) = runs[False], runs[True]
    assert sorted(masked.history[1]["sites"]) == [0, 1, 2] and masked.history[1]["round/train_steps"] == sum(sizes)
    assert masked.history[1]["failures"] == []
    initial = task.get_weights(task.new_trainer("CartPole-v1", task.default_variant(1), seed=0))
    assert list(masked_weights) == list(plain_weights) == list(initial)
    moved = max(float(np.abs(plain_weights[k] - initial[k]).max()) for k in initial)
    gap = max(float(np.abs(masked_weights[k] - plain_weights[k]).max()) for k in initial)
    print(
        f"round 1 moved the model by {moved:.4f}; SecAgg+ vs plain FedAvg differ by at most {gap:.2e}; round 1 took "
        f"{masked.history[1]['round/seconds']:.2f}s with SecAgg+, {plain.history[1]['round/seconds']:.2f}s without"
    )
    # SecAgg+ quantises the masked updates (2^22 levels over [-8, 8]): close to plain FedAvg but not bit-equal,
    # which also shows the masked path (not the plain one) produced the model.
    assert moved > 0.05 and 0 < gap < 1e-3, (moved, gap)
