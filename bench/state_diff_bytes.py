"""Bytes on the wire with and without ``state_diff`` (issue 3), on vector envs and on pixel frames.

Three observation streams, all real:
- CartPole: a ``RemoteEnv`` rollout (``--envs`` copies x ``--steps`` steps, the training path ``RemoteEnv.collect``
  with a fresh PPO policy); the whole rollout's bytes as shipped (``perf/rollout_bytes``) with ``state_diff`` off and
  on, plus the observation array alone.
- HalfCheetah-v5 (the article's "87 % less data" env): the same, with a fresh SAC actor (what trains it by default);
  its observations are float64 MuJoCo states. The float32 figure is a reference: what the observations would weigh
  cast to the float32 the networks read (not a codec mode).
- pixels: CartPole ``rgb_array`` frames (600x400x3 uint8, gymnasium's renderer via pygame) from
  ``--pixel-envs`` copies x ``--pixel-steps`` random-action steps.
Each stream is also compressed with plain zstd at the same level (no deltas), the reference that shows what the
delta step adds. Every encoding is decoded and checked bit-exact. Final line:
{"vector_saving": ..., "halfcheetah_saving": ..., "pixel_saving": ..., "vector_vs_zstd": ..., ...}
where ``*_saving`` = 1 - sent/raw (whole rollouts for the vector envs) and ``*_vs_zstd`` = plain-zstd bytes /
state_diff bytes of the observations.

    .venv/bin/python bench/state_diff_bytes.py [--envs 16] [--steps 128] [--pixel-envs 4] [--pixel-steps 64]
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame renders off-screen; no display here

import gymnasium as gym
import numpy as np
import torch
import zstandard
from rich.progress import Progress

from opentinker.agents.actors import SquashedGaussianActor
from opentinker.agents.policies import ActorCritic, policy_spec
from opentinker.envs import RemoteEnv, decode_observations, encode_observations

LEVEL = 3  # the codec's default zstd level, used for the plain-zstd reference too


def codec_figures(obs: np.ndarray) -> dict:
    """Raw, plain-zstd and state_diff sizes of one (time-first) observation array; checks the round trip."""
    t0 = time.perf_counter()
    encoded = encode_observations(obs, level=LEVEL)
    encode_s = time.perf_counter() - t0
    if decode_observations(encoded).tobytes() != obs.tobytes():
        raise AssertionError("state_diff round trip is not bit-exact")
    plain = len(zstandard.ZstdCompressor(level=LEVEL).compress(obs.tobytes()))
    return {
        "raw": obs.nbytes,
        "zstd": plain,
        "state_diff": len(encoded),
        "encode_mb_per_s": round(obs.nbytes / 1e6 / encode_s, 1),
    }


def vector_rollout(env_id: str, envs: int, steps: int, state_diff: bool):
    """One rollout through ``RemoteEnv.collect`` with a fresh policy of the algorithm that trains the env by default
    (PPO's actor-critic; SAC's squashed-Gaussian actor for a continuous MuJoCo env)."""
    env = RemoteEnv(env_id, parallel=envs, backend="local", state_diff=state_diff, seed=0)
    try:
        obs_space, act_space = env.single_observation_space, env.single_action_space
        torch.manual_seed(0)  # the same fresh policy for both runs, so they see the same trajectories
        if isinstance(act_space, gym.spaces.Box):
            spec = policy_spec(obs_space, act_space, False, (256, 256), "relu", actor="squashed_gaussian")
            policy = SquashedGaussianActor(spec)
        else:
            spec = policy_spec(obs_space, act_space, False, (64, 64), "tanh")
            policy = ActorCritic(spec)
        return env.collect(policy.numpy_weights(), spec, steps, 0)
    finally:
        env.close()


def vector_figures(env_id: str, envs: int, steps: int) -> tuple[dict, dict, np.ndarray]:
    """(whole-rollout bytes off/on, observation codec figures, the observations) for one env, checked equal after
    decoding."""
    plain, diffed = (vector_rollout(env_id, envs, steps, flag) for flag in (False, True))
    if not np.array_equal(diffed.decode().obs, plain.obs):
        raise AssertionError(f"{env_id}: state_diff rollout observations differ from the plain rollout's")
    return {"off": plain.bytes_sent, "on": diffed.bytes_sent}, codec_figures(plain.obs), plain.obs


def pixel_frames(envs: int, steps: int) -> np.ndarray:
    """(steps, envs, 400, 600, 3) uint8 frames of CartPole under random actions (seeded)."""
    make = lambda: gym.wrappers.AddRenderObservation(gym.make("CartPole-v1", render_mode="rgb_array"))  # noqa: E731
    vec = gym.vector.SyncVectorEnv([make] * envs)
    try:
        obs, _ = vec.reset(seed=0)
        vec.action_space.seed(0)
        frames = np.empty((steps, *obs.shape), obs.dtype)
        for t in range(steps):
            frames[t] = obs
            obs, *_ = vec.step(vec.action_space.sample())
        return frames
    finally:
        vec.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--envs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--pixel-envs", type=int, default=4)
    parser.add_argument("--pixel-steps", type=int, default=64)
    args = parser.parse_args()
    with Progress() as progress:
        task = progress.add_task("CartPole rollout", total=4)
        rollout, vector, _ = vector_figures("CartPole-v1", args.envs, args.steps)
        progress.update(task, advance=1, description="HalfCheetah rollout")
        cheetah_rollout, cheetah, cheetah_obs = vector_figures("HalfCheetah-v5", args.envs, args.steps)
        cheetah["float32_state_diff"] = len(encode_observations(cheetah_obs.astype(np.float32), level=LEVEL))
        progress.update(task, advance=1, description="pixel frames")
        frames = pixel_frames(args.pixel_envs, args.pixel_steps)
        progress.update(task, advance=1, description="pixel codec")
        pixels = codec_figures(frames)
        progress.update(task, advance=1)
    print(
        json.dumps(
            {
                "vector_saving": round(1 - rollout["on"] / rollout["off"], 3),
                "halfcheetah_saving": round(1 - cheetah_rollout["on"] / cheetah_rollout["off"], 3),
                "halfcheetah_obs_saving": round(1 - cheetah["state_diff"] / cheetah["raw"], 3),
                "pixel_saving": round(1 - pixels["state_diff"] / pixels["raw"], 4),
                "vector_vs_zstd": round(vector["zstd"] / vector["state_diff"], 2),
                "halfcheetah_vs_zstd": round(cheetah["zstd"] / cheetah["state_diff"], 2),
                "pixel_vs_zstd": round(pixels["zstd"] / pixels["state_diff"], 2),
                "vector_rollout_bytes": rollout,
                "halfcheetah_rollout_bytes": cheetah_rollout,
                "vector_obs": vector,
                "halfcheetah_obs": cheetah,
                "pixel_obs": pixels,
                "shapes": {"vector": [args.steps, args.envs], "pixel": list(frames.shape)},
            }
        )
    )


if __name__ == "__main__":
    main()
