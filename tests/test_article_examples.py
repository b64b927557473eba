"""The article's examples (the README shows them too), each copied exactly as printed; only its `...`
placeholders and `my_dataset` are filled in, and names a snippet uses without importing are imported above it.
Then the article's troubleshooting table as behaviour: a reset connection, a worker out of memory, NaN under AMP."""

from __future__ import annotations

import math
import socket
import struct
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import gymnasium as gym
import httpx
import numpy as np
import pytest
import torch
from fixtures.federated import expert_transitions, small_fed_config

from opentinker import RemoteEnv, remote  # example 2 uses both; example 1 imports RemoteEnv itself
from opentinker.envs import EnvAPIWarning, EnvSpecError, WorkerOutOfMemoryError

# -- 1. The core workflow -----------------------------------------------------------------------------------------
EXAMPLE_1 = """
from opentinker import RemoteEnv, PPOTrainer
env = RemoteEnv('CartPole-v1')            # the env instance runs on the cluster
trainer = PPOTrainer(env, policy='MLP')
trainer.train(steps=1e6)                  # triggers distributed training (note: a float)
# deploying as an API service takes one line
service = trainer.deploy(api_key='your_key')
"""


@pytest.mark.slow
def test_example_1_core_workflow_as_written(tmp_path):
    """The whole snippet, 1e6 steps included, in a fresh interpreter (as a reader runs it); then the service answers."""
    script = tmp_path / "example_1.py"
    script.write_text(
        EXAMPLE_1 + "print('ACTION', service.predict([0.0, 0.1, 0.0, -0.1]), trainer.global_step,\n"
        "      trainer.evaluate(episodes=5).mean)\nservice.stop()\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    action, steps, mean = done.stdout.split("ACTION")[1].split()
    assert int(action) in (0, 1) and int(steps) >= 1_000_000 and float(mean) > 195.0  # CartPole solved


def test_train_steps_accept_integral_floats_only():
    from opentinker import PPOTrainer

    trainer = PPOTrainer(RemoteEnv("CartPole-v1", parallel=2), policy="MLP", n_steps=8, device="cpu")
    trainer.train(steps=16.0)
    assert trainer.global_step == 16
    for bad in (1.5e3 + 0.5, -1e3, 0.0, True, "1e6"):
        with pytest.raises(ValueError, match=r"train steps must be a whole number >= 1 .*got"):
            trainer.train(steps=bad)


# -- 2. A custom environment (the article subclasses RemoteEnv) ------------------------------------------------------
class MyEnv(RemoteEnv):
    def __init__(self):
        super().__init__(parallel=4)  # parallelism of each env instance
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)  # must be defined explicitly
        self.action_space = gym.spaces.Discrete(2)  # otherwise serialisation fails

    @remote(priority=2)  # a high-priority task
    def step(self, action):
        # use numpy, not torch tensors
        obs, reward, done, info = np.full(2, 0.5 * action, np.float32), float(action), False, {}
        return obs, reward, done, info  # note: the old 4-tuple


def test_example_2_subclass_runs_on_ray_workers(ray_session):
    from opentinker import PPOTrainer
    from opentinker.envs.remote import workers_can_import

    assert not workers_can_import(__name__)  # a test file: the class travels to the workers by value
    with pytest.warns(EnvAPIWarning, match=r"old gym 4-tuple .* 5-tuple"):
        env = MyEnv()
    try:
        assert env.backend == "ray" and env.num_envs == 4 and env.single_action_space == gym.spaces.Discrete(2)
        assert set(env.worker_pids()).isdisjoint({__import__("os").getpid()})
        obs, reward, done, info = env.step(1)  # the @remote method itself, as a Ray task
        np.testing.assert_array_equal(obs, [0.5, 0.5])
        assert (reward, done, info) == (1.0, False, {})
        trainer = PPOTrainer(env, policy="MLP", n_steps=8, device="cpu")
        metrics = trainer.train(steps=64)
        assert trainer.global_step == 64 and metrics["perf/rollout_s"] > 0
    finally:
        env.close()


class PointEnv(RemoteEnv):
    """A full env written as the article writes one: old 4-tuple, a time limit reported through info."""

    def __init__(self, parallel=2, ballast=0):
        super().__init__(parallel=parallel, backend="local")
        self.observation_space = gym.spaces.Box(-10.0, 10.0, (1,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.ballast = np.zeros(ballast, np.uint8)

    def reset(self, seed=None, options=None):
        self.x, self.t = 0.0, 0
        return np.array([self.x], np.float32), {}

    def step(self, action):
        self.x += 1.0 if action else -1.0
        self.t += 1
        at_goal, out_of_time = abs(self.x) >= 3, self.t >= 5
        info = {"TimeLimit.truncated": True} if out_of_time and not at_goal else {}
        return np.array([self.x], np.float32), float(at_goal), at_goal or out_of_time, info


def test_subclass_converts_the_old_4_tuple_honouring_time_limits():
    from opentinker.envs.remote_env import SubclassEnv

    env = PointEnv()
    try:
        copy = env.env()  # one copy, as a worker builds it
        assert isinstance(copy, SubclassEnv) and copy.instance is not env
        copy.reset(seed=0)
        outcomes = [copy.step(1)[2:4] for _ in range(3)]
        assert outcomes == [(False, False), (False, False), (True, False)]  # reached x=3: terminated
        copy.reset(seed=0)
        outcomes = [copy.step(i % 2)[2:4] for i in range(5)]
        assert outcomes[-1] == (False, True)  # TimeLimit.truncated: truncated, not terminated
        obs, _ = env.reset(seed=0)  # the subclass's own reset, on the driver
        assert obs.shape == (1,)
    finally:
        env.close()


def test_subclass_missing_space_fails_at_construction_naming_the_field():
    class NoActions(RemoteEnv):
        def __init__(self):
            super().__init__(parallel=2)
            self.observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
            self.action_space = ...

    with pytest.raises(EnvSpecError, match=r"NoActions\.action_space must be a gymnasium\.spaces\.Space, got ellipsis"):
        NoActions()


def test_subclass_that_pickles_large_warns_with_the_size():
    with pytest.warns(UserWarning, match=r"PointEnv pickles to 2\.0 MiB \(over 1 MiB\).*large in-memory objects"):
        env = PointEnv(parallel=1, ballast=2 << 20)
    env.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", category=EnvAPIWarning)
        PointEnv(parallel=1).close()  # small: no size warning


# -- 3. Multi-agent groups -------------------------------------------------------------------------------------------
def test_example_3_agent_group_configure():
    from opentinker.multiagent import AgentGroup

    group = AgentGroup(
        policy_mapping={"predator": "PPO", "prey": "DQN"},
        shared_memory=True,  # lets agents communicate
    )
    # hyper-parameters set per group
    group.configure(predator={"lr": 3e-4, "gamma": 0.99}, prey={"epsilon_decay": 0.995})

    from opentinker.agents.multiagent import AgentGroup as EngineAgentGroup

    assert AgentGroup is EngineAgentGroup  # one implementation, two import paths
    trainer = group.build("pursuit", num_envs=2, n_steps=8, seed=0, device="cpu", backend="local")
    predator, prey = trainer.trainers["predator"], trainer.trainers["prey"]
    assert predator.optimizer.param_groups[0]["lr"] == pytest.approx(3e-4) and predator.config.gamma == 0.99
    trainer.train(steps=64)
    t = prey.global_step // prey.config.num_envs  # joint steps of each env copy
    assert t == 32 and prey.epsilon() == pytest.approx(max(prey.config.end_e, 0.995**t))
    with pytest.raises(
        ValueError,
        match=r"configure\(prey=\.\.\.\): unknown DQN hyper-parameter 'epsilon_dacay'; "
        r"valid: \[.*'epsilon_decay'.*'lr'.*\]",
    ):
        group.configure(prey={"epsilon_dacay": 0.9})


# -- 4. LLM agents ---------------------------------------------------------------------------------------------------
def test_example_4_hosted_model_offline_says_what_to_configure(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    from opentinker.llm import PythonREPL, WebSearch  # the snippet uses both without importing them

    with pytest.raises(ValueError, match=r"llm='gpt-4'.*langchain-openai.*OPENAI_API_KEY.*llm='local'"):
        from opentinker.llm import LangChainAgent

        agent = LangChainAgent(llm="gpt-4", tools=[WebSearch(), PythonREPL()], memory_window=5)
        # tool calls are parallelised automatically
        result = agent.run("Analyse the NASDAQ:TSLA price trend over the last 30 days")  # noqa: F841


# -- 5. Federated training, over Flower's REST transport with TLS --------------------------------------------------
@pytest.fixture(scope="module")
def article_federation():
    """A SuperLink (TLS, SuperNode auth) where ``FLClient`` looks by default, with site 0's key registered."""
    from opentinker.federated import deploy
    from opentinker.federated.certs import generate_certs

    root = deploy.default_root()
    root.mkdir(parents=True, exist_ok=True)
    certs = generate_certs(root / "certs", 1)
    fed = deploy.start_superlink(root, certs, transport="rest")
    try:
        deploy.register_site(fed, 0, certs.site_public_key(0))
        yield fed
    finally:
        deploy.down(root)


@pytest.mark.slow
def test_example_5_federated_client_round_over_rest_with_tls(article_federation, tmp_path):
    from opentinker.federated import FLServer

    my_dataset = tmp_path / "site-0.npz"  # a path to this site's transitions
    np.savez(my_dataset, **expert_transitions(0, episodes=4, seed=0))

    from opentinker.federated import FLClient

    client = FLClient(
        strategy="fedavg",
        aggregation_interval=300,  # aggregate every 5 minutes
    )
    # each party's local data never leaves it
    client.train(local_data=my_dataset)

    assert client.transport == "rest" and article_federation.address.startswith("127.0.0.1:")
    settings = {k: v for k, v in vars(small_fed_config()).items() if k not in ("strategy", "num_server_rounds")}
    settings.update(num_sites=1, min_completion_rate=1.0, run_name="article-example-5", eval_episodes=2)
    result = FLServer(strategy="fedavg", rounds=1, transport="rest", **settings).run(timeout=600)
    assert result.status == "FINISHED" and result.rounds == 1 and result.history[-1]["round/train_steps"] > 0
    ca = article_federation.cert_paths.ca_cert  # the SuperLink speaks HTTPS only, with the federation's CA
    assert httpx.get(f"https://{article_federation.address}/", verify=str(ca)).status_code < 500
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{article_federation.address}/")


@pytest.mark.parametrize("transport", ["grpc", "websocket"])
def test_transports_flower_lacks_are_refused_with_the_fix(transport):
    from opentinker.federated import FLClient
    from opentinker.federated.config import FederatedConfigError

    with pytest.raises(FederatedConfigError, match=rf"transport='{transport}'.*transport='rest'"):
        FLClient(transport=transport)


@pytest.mark.slow  # a real Flower federation
def test_connection_reset_names_cause_and_fix(article_federation):
    """A 'firewall' that resets every connection: the site's error says ConnectionReset, why, and what to do."""
    from opentinker.federated import deploy
    from opentinker.federated.config import SiteConfig

    resetter = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def reset_all() -> None:
        resetter.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = resetter.accept()
            except TimeoutError:
                continue
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # RST instead of FIN

    thread = threading.Thread(target=reset_all, daemon=True)
    thread.start()
    try:
        with pytest.raises(deploy.FederationError, match=r"ConnectionReset: .*firewall.*transport='rest'"):
            deploy.start_site(
                article_federation,
                SiteConfig(site_id=0),
                timeout=120,
                max_wait_time=5,
                address=f"127.0.0.1:{resetter.getsockname()[1]}",
            )
    finally:
        stop.set()
        thread.join()
        resetter.close()


# -- 6. Troubleshooting: a worker out of memory, NaN under mixed precision ---------------------------------------------
class Hungry(gym.Env):
    """Each step caps its own process's address space 256 MiB above what it uses, then allocates 1 GiB."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(4, np.float32), {}

    def step(self, action):
        import resource

        used = int(Path("/proc/self/status").read_text().split("VmSize:")[1].split()[0]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (used + (256 << 20), resource.RLIM_INFINITY))
        np.ones(1 << 30, np.uint8)
        return np.zeros(4, np.float32), 0.0, False, False, {}


def test_worker_out_of_memory_names_state_diff_and_parallel(ray_session):
    from opentinker import PPOTrainer

    env = RemoteEnv(Hungry, parallel=1, backend="ray", validate=False)
    try:
        trainer = PPOTrainer(env, policy="MLP", n_steps=8, device="cpu")
        with pytest.raises(WorkerOutOfMemoryError, match=r"OOM on worker during collect: .*state_diff=True.*parallel"):
            trainer.train(steps=8)
    finally:
        env.close()


@pytest.mark.parametrize("amp_mode", ["bf16", "fp16"])
@pytest.mark.parametrize("poison", ["loss", "gradient"])
def test_nan_under_amp_names_safe_mode(amp_mode, poison):
    """Forced NaN, in the loss (a NaN weight) or only in a gradient (a backward hook); fp16's loss scaler first skips
    steps and halves its scale, so its error comes once the scale is down to 1 (17 skipped steps)."""
    from opentinker import PPOTrainer
    from opentinker.agents.amp import AmpNaNError

    trainer = PPOTrainer("CartPole-v1", policy="MLP", amp_mode=amp_mode, device="cpu", num_envs=2, n_steps=8)
    weight = trainer.policy.critic[0].weight
    if poison == "loss":
        with torch.no_grad():
            weight[0, 0] = math.nan
    else:
        weight.register_hook(lambda grad: grad * math.nan)
    with pytest.raises(AmpNaNError, match=rf"non-finite {poison} .*under amp_mode='{amp_mode}'.*Set amp_mode='safe'"):
        trainer.train(steps=64)  # 16 optimiser steps per iteration
