"""Flower's deployment engine with real processes on loopback: one SuperLink (TLS, SuperNode auth) and one
SuperNode per site, started once per session by the `federation` fixture (`deploy.up(3)`)."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import numpy as np
import pytest
from fixtures.federated import expert_transitions, small_fed_config

from opentinker.federated import deploy
from opentinker.federated.api import FLClient
from opentinker.federated.certs import CertPaths, generate_certs, generate_site_key
from opentinker.federated.config import SiteConfig
from opentinker.flows.federated_flow import federated_flow
from opentinker.infra.processes import wait_until
from opentinker.tracking.registry import load_registered_policy

pytestmark = pytest.mark.slow  # starts real services or trains through a flow


def test_site_with_an_unregistered_key_is_refused(federation, tmp_path):
    stranger = CertPaths(tmp_path)
    generate_site_key(stranger, 7)
    with pytest.raises(deploy.FederationError, match="exited with code"):
        deploy.start_site(federation, SiteConfig(site_id=7), private_key=stranger.site_key(7), timeout=300)
    assert "Failed to activate SuperNode" in (Path(federation.root) / "site-7" / "supernode.log").read_text()


def test_site_trusting_another_ca_cannot_connect(federation, tmp_path):
    other = generate_certs(tmp_path / "other-ca", 1)
    with pytest.raises(deploy.FederationError):
        deploy.start_site(
            federation,
            SiteConfig(site_id=8),
            private_key=federation.cert_paths.site_key(0),
            root_cert=other.ca_cert,
            timeout=300,
            max_wait_time=5,
        )
    assert "8" not in federation.site_pids


def test_killed_site_mid_round_round_completes_and_site_rejoins(federation):
    """Site 2's SuperNode dies while training round 1: the floor (2 of 3) is met, and site 2 is back in round 2 —
    rejoining with an offline dataset (behaviour cloning) next to two PPO sites.

    The run goes through the Prefect `federated_flow` (federation check → flwr run → registry check)."""
    config = small_fed_config(
        run_name="deploy-kill",
        num_server_rounds=2,
        min_completion_rate=0.6,
        round_timeout=180.0,
        register_as="fed-deploy",
    )
    outcome: dict = {}
    flow_args = dict(config=dataclasses.asdict(config), root=federation.root)
    runner = threading.Thread(target=lambda: outcome.update(result=federated_flow(**flow_args)))
    runner.start()
    try:
        wait_until(federation.sites["2"], "Receiving: train message", 600, "site 2 received a train message")
        federation.sites["2"].stop()  # the whole process group: supernode, superexec, clientapp
        # Same key, same node id: the site rejoins through the seed API, now training on in-memory transitions.
        dataset = expert_transitions(site_id=2, episodes=1, seed=3)
        FLClient(strategy="fedavg", aggregation_interval=60, site_id=2, federation=federation.root).train(
            local_data={"dataset": dataset, "pole_length": 0.65, "gravity": 10.78}
        )
        federation.sites.update(deploy.Federation.load(federation.root).sites)
    finally:
        runner.join(timeout=1500)
    result = outcome["result"]
    assert result["status"] == "FINISHED", result
    round1, round2 = result["history"][1], result["history"][2]
    assert sorted(round1["sites"]) == [0, 1] and any("no reply" in f or "node" in f for f in round1["failures"])
    assert sorted(round2["sites"]) == [0, 1, 2], round2["failures"]
    assert (Path(federation.root) / "site-2" / "dataset.npz").exists()
    assert round2["round/bytes_received"] > 0 and round2["round/seconds"] > 0
    assert result["model_uri"] == "models:/fed-deploy@federated"
    policy = load_registered_policy(result["model_uri"])  # the serving side's way in
    assert policy.act(np.zeros((2, 4), dtype=np.float32)).shape == (2,)
