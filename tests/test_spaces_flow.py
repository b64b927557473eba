"""Every kind of space through the whole pipeline: ``train_flow`` (probe with random actions of each space, training,
evaluation, registry, gate) on the shipped identity envs, then each registered version served by a real
``bentoml serve``: the action over HTTP equals the action in-process, for single observations and batches, and a
malformed Dict or image observation gets a 400 naming the part at fault."""

from __future__ import annotations

import httpx
import mlflow
import numpy as np
import pytest
from fixtures.serving import deploy_all

from opentinker.envs import make_env
from opentinker.envs.observations import index_obs, map_obs, stack_obs
from opentinker.infra.settings import get_settings

pytestmark = pytest.mark.slow
API_KEY = "spaces-flow-key"
ENVS = {
    "dict": "opentinker.envs.identity:DictIdentityEnv",
    "multi-discrete": "opentinker.envs.identity:MultiDiscreteIdentityEnv",
    "multi-binary": "opentinker.envs.identity:MultiBinaryIdentityEnv",
    "image": "opentinker.envs.identity:ImageIdentityEnv",
}


def _observations(env_id: str, n: int):
    env = make_env(env_id)
    rows = [env.reset(seed=seed)[0] for seed in range(n)]
    env.close()
    return stack_obs(rows)


def test_every_space_trains_through_the_flow_and_serves_the_same_action_over_http():
    from opentinker.flows.params import TrainParams
    from opentinker.flows.train import train_flow
    from opentinker.tracking.registry import load_registered_policy

    results = {
        name: train_flow(
            TrainParams(
                env_id=env_id,
                steps=512,
                seed=1,
                num_envs=4,
                backend="local",
                eval_episodes=2,
                champion_threshold=0.0,
                ppo={"n_steps": 32},
                model_name=f"spaces-{name}",
                run_name=f"spaces-{name}",
            )
        )
        for name, env_id in ENVS.items()
    }
    client = mlflow.MlflowClient(get_settings().tracking_uri)
    for name, result in results.items():
        metrics = client.get_run(result.run_id).data.metrics
        assert "charts/random_policy_return" in metrics, name  # the probe stepped random actions of this space
        assert result.global_step >= 512 and "champion" in result.aliases, (name, result)

    refs = {name: f"models:/{r.model_name}/{r.model_version}" for name, r in results.items()}
    deployments = dict(zip(refs, deploy_all(API_KEY, list(refs.values()))))
    try:
        for name, deployment in deployments.items():
            policy = load_registered_policy(refs[name])
            obs = _observations(ENVS[name], 5)
            in_process = policy.act(obs)
            np.testing.assert_array_equal(deployment.predict_batch(obs), in_process)
            for i in range(2):
                np.testing.assert_array_equal(np.asarray(deployment.predict(index_obs(obs, i))), in_process[i])
            served = deployment.metadata()
            assert served["action_space"]["type"] == type(policy.action_space).__name__, name
        dict_server, image_server = deployments["dict"], deployments["image"]
        assert dict_server.metadata()["observation_space"]["type"] == "Dict"
        _check_bad_requests(dict_server, image_server, _observations(ENVS["dict"], 1))
    finally:
        for deployment in deployments.values():
            deployment.stop()


def _check_bad_requests(dict_server, image_server, dict_obs) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    one = map_obs(lambda leaf: leaf[0].tolist(), dict_obs)
    with httpx.Client(timeout=30) as http:
        missing = http.post(f"{dict_server.url}/act", json={"obs": {"image": one["image"]}}, headers=auth)
        assert missing.status_code == 400 and "keys ['image', 'vector']" in missing.text, missing.text
        bright = {**one, "image": np.full((8, 8, 1), 300).tolist()}
        too_bright = http.post(f"{dict_server.url}/act", json={"obs": bright}, headers=auth)
        assert too_bright.status_code == 400 and "obs['image'][0][0][0] = 300" in too_bright.text, too_bright.text
        flat = {**one, "vector": [0.5]}
        short = http.post(f"{dict_server.url}/act_batch", json={"obs": [one, flat]}, headers=auth)
        assert short.status_code == 400 and "obs[1]: obs['vector']: expected shape (2,)" in short.text, short.text
        image = np.zeros((16, 16, 3), np.int64)
        image[3, 4, 2] = -1
        dark = http.post(f"{image_server.url}/act", json={"obs": image.tolist()}, headers=auth)
        assert dark.status_code == 400 and "obs[3][4][2] = -1" in dark.text, dark.text
