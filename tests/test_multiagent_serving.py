"""Serving one kind of a trained AgentGroup: the prey's DQN export behind a real ``bentoml serve``, over HTTP.

With shared memory on, a kind's policy observes its own observation with the channel appended (the previous
step's mean observation per kind), so that is what a client sends; the raw observation alone is refused.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from fixtures.serving import SERVING_API_KEY

from opentinker.agents.multiagent import AgentGroup
from opentinker.serving.deploy import deploy

pytestmark = pytest.mark.slow  # starts real services or trains through a flow

SMALL = dict(n_predators=2, n_prey=3, grid_size=6, max_cycles=12)
FAST_PREY = {"learning_starts": 64, "buffer_size": 512, "batch_size": 32, "train_frequency": 8}
AUTH = {"Authorization": f"Bearer {SERVING_API_KEY}"}


def test_a_kinds_exported_policy_is_served_over_http(tmp_path):
    group = AgentGroup({"predator": "PPO", "prey": "DQN"}, shared_memory=True).configure(prey=FAST_PREY)
    trainer = group.build("pursuit", num_envs=2, n_steps=16, seed=5, device="cpu", backend="local", **SMALL)
    assert "prey/losses/td_loss" in trainer.train(96), "the prey's Q network was updated before export"
    export = trainer.export(tmp_path / "export")["prey"]
    policy = trainer.policies()["prey"]
    obs = trainer.joint.observations("prey")  # own observation + predators' and prey's channel means
    raw_dim = trainer.joint.raw_spaces["prey"].shape[0]
    assert obs.shape == (2 * SMALL["n_prey"], 3 * raw_dim)
    action_space = trainer.action_spaces["prey"]

    with (
        deploy(export, SERVING_API_KEY, log_path=tmp_path / "server.log") as service,
        httpx.Client(base_url=service.url, timeout=30) as http,
    ):
        meta = http.post("/metadata", json={}, headers=AUTH).json()
        assert meta["algorithm"] == "dqn" and meta["observation_space"]["shape"] == [3 * raw_dim]
        for row in obs:
            resp = http.post("/act", json={"obs": row.tolist()}, headers=AUTH)
            assert resp.status_code == 200, resp.text
            action = resp.json()["action"]
            assert action_space.contains(np.int64(action)), action
            assert action == int(policy.act(row[None])[0])
        batch = http.post("/act_batch", json={"obs": obs.tolist()}, headers=AUTH)
        assert batch.status_code == 200, batch.text
        np.testing.assert_array_equal(np.asarray(batch.json()), policy.act(obs))
        refused = http.post("/act", json={"obs": obs[0, :raw_dim].tolist()}, headers=AUTH)
        assert refused.status_code == 400, "an observation without the shared-memory channel is not this policy's input"
    trainer.close()
