"""state_diff codec: bit-exact round trips on random arrays of every dtype, and real savings on smooth data."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from opentinker.envs import decode_observations, encode_observations

DTYPES = st.sampled_from(["float32", "float64", "float16", "uint8", "int8", "int16", "int32", "int64", "bool"])


@settings(max_examples=100, deadline=None)
@given(hnp.arrays(dtype=DTYPES, shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=7)))
def test_round_trip_is_bit_exact(arr):
    out = decode_observations(encode_observations(arr))
    assert out.dtype == arr.dtype and out.shape == arr.shape
    assert out.tobytes() == np.ascontiguousarray(arr).tobytes()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=64))
def test_special_floats_survive(values):
    arr = np.array(values, dtype=np.float32).reshape(-1, 1)
    arr[0, 0] = -0.0
    out = decode_observations(encode_observations(arr))
    assert out.view(np.uint32).tolist() == arr.view(np.uint32).tolist()  # NaN payloads and -0.0 included


def test_non_contiguous_input():
    base = np.arange(60, dtype=np.float32).reshape(6, 10)
    view = base[:, ::3]
    assert np.array_equal(decode_observations(encode_observations(view)), view)


def test_smooth_trajectories_compress_well():
    t = np.linspace(0, 10, 512, dtype=np.float32)[:, None, None]
    frames = (np.sin(t + np.arange(64, dtype=np.float32)[None, :, None] / 10) * 40 + 100).astype(np.uint8)
    frames = np.repeat(frames, 48, axis=2)  # (512, 64, 48): slowly changing pixel rows
    encoded = encode_observations(frames)
    assert len(encoded) < 0.1 * frames.nbytes


def test_rendered_cartpole_frames_round_trip_and_shrink(monkeypatch):
    monkeypatch.setenv("SDL_VIDEODRIVER", "dummy")
    env = gym.wrappers.AddRenderObservation(gym.make("CartPole-v1", render_mode="rgb_array"))
    obs, _ = env.reset(seed=0)
    frames = [obs]
    for action in [0, 1, 1, 0, 1, 0, 0]:
        frames.append(env.step(action)[0])
    env.close()
    frames = np.stack(frames)  # (8, 400, 600, 3) uint8
    encoded = encode_observations(frames)
    assert decode_observations(encoded).tobytes() == frames.tobytes()
    assert len(encoded) < 0.01 * frames.nbytes


@pytest.mark.parametrize(
    "make",
    [
        lambda rng: np.cumsum(rng.normal(size=(256, 8, 4)), axis=0).astype(np.float32),  # smooth state vectors
        lambda rng: np.repeat(rng.integers(0, 255, size=(1, 32, 32, 3), dtype=np.uint8), 64, axis=0),  # static frames
    ],
)
def test_never_larger_than_plain_zstd(make):
    arr = make(np.random.default_rng(0))
    plain = len(zstandard.ZstdCompressor(level=3).compress(arr.tobytes()))
    encoded = encode_observations(arr)
    assert len(encoded) <= plain + 128  # + magic and JSON header
    assert decode_observations(encoded).tobytes() == arr.tobytes()


def test_rejects_object_arrays_and_garbage():
    with pytest.raises(TypeError, match="holds Python objects"):
        encode_observations(np.array([object()]))
    with pytest.raises(ValueError, match="not a state_diff payload"):
        decode_observations(b"nope")
