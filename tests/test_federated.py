"""Federated building blocks without Flower processes: config validation, server checkpoint, site task, DP mod."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fixtures.federated import train_message
from flwr.app import Context, RecordDict

from opentinker.federated import checkpoint, task
from opentinker.federated.certs import generate_certs
from opentinker.federated.client_app import SiteRefusedError, build_client_app, from_record
from opentinker.federated.config import FedConfig, FederatedConfigError, SiteConfig


def test_run_config_errors_name_the_field():
    with pytest.raises(FederatedConfigError, match="strategy"):
        FedConfig.from_run_config({"strategy": "fedsgd"})
    with pytest.raises(FederatedConfigError, match="unknown key 'rounds'"):
        FedConfig.from_run_config({"rounds": 3})
    with pytest.raises(FederatedConfigError, match="'local-steps' must be int"):
        FedConfig.from_run_config({"local-steps": "many"})
    with pytest.raises(FederatedConfigError, match="min-completion-rate"):
        FedConfig(min_completion_rate=0.0)
    assert FedConfig(num_sites=3, min_completion_rate=0.66).min_replies == 2
    assert FedConfig(num_sites=3, min_completion_rate=1.0).min_replies == 3
    assert FedConfig.from_run_config(FedConfig(strategy="fedprox").to_run_config()).strategy == "fedprox"


def test_site_node_config_round_trips_through_flower_syntax():
    from flwr.common.config import parse_config_args  # how flower-supernode parses --node-config

    site = SiteConfig(
        site_id=2,
        pole_length=0.7,
        state_dir="/tmp/x y",
        strategy="fedavg",
        dp_clip=1.5,
        dataset="/data/site 2/transitions.npz",
    )
    parsed = parse_config_args([site.to_node_config()])
    assert SiteConfig.from_node_config(parsed) == site


def test_checkpoint_keeps_last_complete_round(tmp_path):
    weights = {"a": np.arange(6.0).reshape(2, 3), "b": np.ones(2)}
    checkpoint.save(
        tmp_path, checkpoint.ServerState(1, weights, {"m_t": {"a": np.zeros((2, 3))}}, [{"round": 1}], "run1")
    )
    checkpoint.save(
        tmp_path,
        checkpoint.ServerState(2, {k: v + 1 for k, v in weights.items()}, {}, [{"round": 1}, {"round": 2}], "run1"),
    )
    (tmp_path / ".round-0003.npz.tmp").write_bytes(b"half-written")  # a crash mid-write of round 3
    state = checkpoint.load(tmp_path)
    assert state.round == 2 and state.mlflow_run_id == "run1" and len(state.history) == 2
    np.testing.assert_array_equal(state.weights["a"], weights["a"] + 1)
    assert sorted(p.name for p in tmp_path.glob("round-*.npz")) == ["round-0002.npz"]
    assert json.loads((tmp_path / "latest.json").read_text())["file"] == "round-0002.npz"
    assert checkpoint.load(tmp_path / "empty") is None


def test_site_variants_differ_and_shape_check_names_tensors():
    assert task.default_variant(0) != task.default_variant(1) != task.default_variant(2)
    env = task.make_site_env("CartPole-v1", task.SiteVariant(pole_length=0.9, gravity=12.0))
    assert env.unwrapped.length == 0.9 and env.unwrapped.gravity == 12.0
    expected = {"w": np.zeros((4, 2)), "b": np.zeros(2)}
    with pytest.raises(
        task.WeightShapeError,
        match=r"'w' has shape \(4, 3\), expected \(4, 2\).*missing 'b'|missing 'b'.*'w' has shape",
    ):
        task.check_shapes(expected, {"w": np.zeros((4, 3))}, "reply from site 1")


def _context(tmp_path, **node_config):
    return Context(
        run_id=7, node_id=1, node_config={"state-dir": str(tmp_path), **node_config}, state=RecordDict(), run_config={}
    )


def test_local_dp_clips_the_update_and_a_wrong_strategy_is_refused(tmp_path):
    """Flower's LocalDpMod on the site: the update that leaves the site is clipped to dp-clip (plus noise)."""
    app = build_client_app()
    global_weights = task.get_weights(task.new_trainer("CartPole-v1", task.default_variant(0), seed=0))

    def update_norm(reply):
        got = from_record(reply.content["arrays"])
        return float(np.sqrt(sum(np.sum((got[k] - global_weights[k]) ** 2) for k in global_weights)))

    plain = app(train_message(global_weights, run_id=7), _context(tmp_path / "plain", **{"site-id": 0}))
    assert not plain.has_error() and update_norm(plain) > 0.2
    private = app(
        train_message(global_weights, run_id=7),
        _context(tmp_path / "dp", **{"site-id": 0, "dp-clip": 0.05, "dp-epsilon": 1e6}),
    )
    assert not private.has_error()
    assert update_norm(private) <= 0.05 * 1.01  # clipped; epsilon huge so the Gaussian noise is negligible
    with pytest.raises(SiteRefusedError, match="agreed to strategy 'fedprox' but the run uses 'fedavg'"):
        app(train_message(global_weights, run_id=7), _context(tmp_path / "r", **{"site-id": 0, "strategy": "fedprox"}))


def test_certs_are_reused_and_site_keys_added(tmp_path):
    paths = generate_certs(tmp_path, 2)
    ca = paths.ca_cert.read_bytes()
    generate_certs(tmp_path, 3)
    assert paths.ca_cert.read_bytes() == ca and paths.site_public_key(2).exists()
    assert paths.site_public_key(0).read_text().startswith("ecdsa-sha2-nistp384 ")
    assert (paths.site_key(0).stat().st_mode & 0o777) == 0o600
