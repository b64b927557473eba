"""Bytes on the wire with and without ``state_diff`` (issue 3), on a vector env and on pixel frames.

Two observation streams, both real:
- vector: a CartPole ``RemoteEnv`` rollout (``--envs`` copies x ``--steps`` steps, the training path
  ``RemoteEnv.collect`` with a fresh policy); the whole rollout's bytes as shipped (``perf/rollout_bytes``)
  with ``state_diff`` off and on, plus the observation array alone.
- pixels: CartPole ``rgb_array`` frames (600x400x3 uint8, gymnasium's renderer via pygame) from
  ``--pixel-envs`` copies x ``--pixel-steps`` random-action steps.
Each stream is also compressed with plain zstd at the same level (no deltas), the reference that shows what the
delta step adds. Every encoding is decoded and checked bit-exact. Final line:
{"vector_saving": ..., "pixel_saving": ..., "vector_vs_zstd": ..., "pixel_vs_zstd": ..., ...}
where ``*_saving`` = 1 - sent/raw and ``*_vs_zstd`` = plain-zstd bytes / state_diff bytes.

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


def vector_rollout(envs: int, steps: int, state_diff: bool):
    env = RemoteEnv("CartPole-v1", parallel=envs, backend="local", state_diff=state_diff, seed=0)
    try:
        spec = policy_spec(env.single_observation_space, env.single_action_space, False, (64, 64), "tanh")
        torch.manual_seed(0)  # the same fresh policy for both runs, so they see the same trajectories
        return env.collect(ActorCritic(spec).numpy_weights(), spec, steps, 0)
    finally:
        env.close()


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
        task = progress.add_task("vector rollout", total=3)
        plain, diffed = (vector_rollout(args.envs, args.steps, flag) for flag in (False, True))
        if not np.array_equal(diffed.decode().obs, plain.obs):
            raise AssertionError("state_diff rollout observations differ from the plain rollout's")
        vector = codec_figures(plain.obs)
        progress.update(task, advance=1, description="pixel frames")
        frames = pixel_frames(args.pixel_envs, args.pixel_steps)
        progress.update(task, advance=1, description="pixel codec")
        pixels = codec_figures(frames)
        progress.update(task, advance=1)
    print(
        json.dumps(
            {
                "vector_saving": round(1 - diffed.bytes_sent / plain.bytes_sent, 3),
                "pixel_saving": round(1 - pixels["state_diff"] / pixels["raw"], 4),
                "vector_vs_zstd": round(vector["zstd"] / vector["state_diff"], 2),
                "pixel_vs_zstd": round(pixels["zstd"] / pixels["state_diff"], 2),
                "vector_rollout_bytes": {"off": plain.bytes_sent, "on": diffed.bytes_sent},
                "vector_obs": vector,
                "pixel_obs": pixels,
                "shapes": {"vector": list(plain.obs.shape), "pixel": list(frames.shape)},
            }
        )
    )


if __name__ == "__main__":
    main()
