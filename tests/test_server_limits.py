"""Per-job limits on a real server: a tenant's fork bomb and memory bomb, run inside its own jobs, end those jobs
FAILED with the limit named (the tenant's quota, through the kernel's cgroups), while another tenant's job beside them
finishes unharmed."""

from __future__ import annotations

import sys
import textwrap

import httpx
import pytest
from fixtures.server import wait_for_job

pytestmark = pytest.mark.slow

FINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
SMALL = {"steps": 2048, "num_envs": 2, "eval_episodes": 2, "champion_threshold": 0.0, "ppo": {"n_steps": 64}}
HTTP = httpx.Client(timeout=120)

BOMBS = '''
"""Envs that attack the machine, but only inside a job (the submit-time check builds them too)."""
import os
import time

import gymnasium as gym
import numpy as np


class _Env(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(2, np.float32), float(action), False, self.t >= 20, {}


class ForkBomb(_Env):
    def __init__(self):
        if os.environ.get("OPENTINKER_JOB_ID"):
            for _ in range(300):  # bounded: 300 sleeping children
                try:
                    if os.fork() == 0:
                        time.sleep(120)
                        os._exit(0)
                except OSError:
                    time.sleep(0.05)


class MemoryBomb(_Env):
    def __init__(self):
        if os.environ.get("OPENTINKER_JOB_ID"):
            hog = []
            for _ in range(40):  # bounded: 4 GiB, each page touched
                hog.append(np.ones(100 << 20, np.uint8))
'''


@pytest.fixture(scope="module")
def bombs(job_server, tmp_path_factory):
    from opentinker.server.client import Client

    server = job_server
    admin = server.headers(server.admin_key)
    limits = {"forks": {"job_max_processes": 64}, "hogs": {"job_memory_mb": 1536}}
    keys = {tenant: server.make_key(tenant) for tenant in (*limits, "bystander")}
    for tenant, quota in limits.items():
        assert HTTP.patch(f"{server.url}/v1/tenants/{tenant}", headers=admin, json=quota).status_code == 200
    code = tmp_path_factory.mktemp("bombs-code")
    (code / "bombs").mkdir()
    (code / "bombs" / "__init__.py").write_text("")
    (code / "bombs" / "envs.py").write_text(textwrap.dedent(BOMBS))
    sys.path.insert(0, str(code))
    try:
        jobs = {
            "forks": Client(server.url, keys["forks"]).submit({"env_id": "bombs.envs:ForkBomb", **SMALL}),
            "hogs": Client(server.url, keys["hogs"]).submit({"env_id": "bombs.envs:MemoryBomb", **SMALL}),
            "bystander": Client(server.url, keys["bystander"]).submit({"env_id": "CartPole-v1", **SMALL}),
        }
    finally:
        sys.path.remove(str(code))
    return {
        name: wait_for_job(server, keys[name], job["id"], lambda s: s["state"] in FINAL, timeout=400)
        for name, job in jobs.items()
    }


def test_a_fork_bomb_ends_its_job_failed_naming_the_process_limit(bombs):
    assert bombs["forks"]["state"] == "FAILED", bombs["forks"]
    assert "process limit 64 exceeded" in bombs["forks"]["reason"], bombs["forks"]["reason"]


def test_a_memory_bomb_ends_its_job_failed_naming_the_memory_limit(bombs):
    assert bombs["hogs"]["state"] == "FAILED", bombs["hogs"]
    assert "memory limit 1.5 GiB exceeded" in bombs["hogs"]["reason"], bombs["hogs"]["reason"]


def test_another_tenants_job_beside_them_finishes_unharmed(bombs):
    assert bombs["bystander"]["state"] == "SUCCEEDED", bombs["bystander"]
    assert bombs["bystander"]["attempts"] == 1
