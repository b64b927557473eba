"""The numpy forward pass rollout workers and servers run, against the torch policy it mirrors, per kind of space.

For each case one freshly initialised PPO actor-critic is built from the engine's spec; the reference is its torch
forward (actions, log-probabilities and values of a batch, no gradient, one torch thread), measured in the same
command on the same observations as ``NumpyPolicy.sample``. CPU time (``time.process_time``), best of ``--repeats``
rounds of ``--calls`` calls, so other processes on the machine move it little. Cases: CartPole's 4-64-64 MLP on 64
observations (the fast path), Atari frames (4x84x84 uint8, the Nature CNN) on 8, and a Dict of a 16x16 image and a
vector (the combined extractor) on 16. Ends with one JSON line ``{"<case>": {"numpy_ms", "torch_ms", "ratio"}, ...}``
(ratio = numpy time / torch time; below 1 the numpy pass is faster).

    .venv/bin/python bench/policy_forward.py [--calls 50] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import time

import gymnasium as gym
import numpy as np
import torch

from opentinker.agents.policies import ActorCritic, policy_spec
from opentinker.envs.numpy_policy import NumpyPolicy
from opentinker.envs.observations import map_obs, stack_obs

CASES = {
    "cartpole_mlp_64": (gym.make("CartPole-v1").observation_space, gym.spaces.Discrete(2), (64, 64), 64),
    "atari_nature_cnn_8": (gym.spaces.Box(0, 255, (4, 84, 84), np.uint8), gym.spaces.Discrete(4), (), 8),
    "dict_image_vector_16": (
        gym.spaces.Dict(
            {
                "image": gym.spaces.Box(0, 255, (16, 16, 3), np.uint8),
                "vector": gym.spaces.Box(-1.0, 1.0, (8,), np.float32),
            }
        ),
        gym.spaces.MultiDiscrete([3, 3]),
        (64, 64),
        16,
    ),
}


def best_ms(call, calls: int, repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(calls):
            call()
        best = min(best, (time.process_time() - start) / calls)
    return best * 1e3


def measure(case: str, calls: int, repeats: int) -> dict[str, float]:
    obs_space, action_space, hidden, batch = CASES[case]
    torch.manual_seed(0)
    policy = ActorCritic(policy_spec(obs_space, action_space, False, hidden, "tanh"))
    twin = NumpyPolicy(policy.spec, policy.numpy_weights())
    obs_space.seed(0)
    obs = stack_obs([obs_space.sample() for _ in range(batch)])
    rng = np.random.default_rng(0)
    actions = torch.as_tensor(twin.sample(obs, rng)[0])

    def torch_forward() -> None:
        with torch.no_grad():
            policy.evaluate_actions(policy.preprocess(map_obs(torch.as_tensor, obs)), actions)

    numpy_ms = best_ms(lambda: twin.sample(obs, rng), calls, repeats)
    torch_ms = best_ms(torch_forward, calls, repeats)
    return {"numpy_ms": round(numpy_ms, 4), "torch_ms": round(torch_ms, 4), "ratio": round(numpy_ms / torch_ms, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    for case in CASES:
        results[case] = measure(case, args.calls, args.repeats)
        print(case, results[case], flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
