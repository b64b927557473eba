"""One tenant's long sampling request does not hold the shared worker from the others: after ``engine.SLICE_S`` the
work waiting behind it runs between two of its decode steps, and the long request's tokens are those it gets alone.

The official SDK trains; the long request is raw HTTP from a second tenant; the shared tiny-model server
(``fixtures.tinker``)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from fixtures.tinker import TINY, wait_all
from tinker import types

pytestmark = pytest.mark.slow

LONG = {"max_tokens": 160, "stop": [], "seed": 0}
"""32 rows of 160 tokens: several seconds of decoding on the tiny model, many times ``SLICE_S``."""


def _long_sample(http, sampler: str, seq_id: int) -> str:
    sample = types.SampleRequest(
        sampling_session_id=sampler,
        seq_id=seq_id,
        num_samples=32,
        prompt=types.ModelInput.from_ints([1, 2, 3]),
        sampling_params=types.SamplingParams(**LONG),
    )
    return http.post("/api/v1/asample", json=sample.model_dump(mode="json", exclude_none=True)).json()["request_id"]


def test_a_long_sampling_request_lets_another_tenant_train_between_its_decode_steps(tinker_server):
    service = tinker_server.service_client("fair")
    training = service.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    tokens = list(range(100, 140))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": np.ones(len(tokens) - 1, np.float32)},
    )

    def step() -> float:
        """One forward_backward and optim_step through the SDK: seconds to both results."""
        started = time.monotonic()
        fb = training.forward_backward([datum], "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=1e-3))
        fb.result(), optim.result()
        return time.monotonic() - started

    step()  # warm
    alone_s = step()
    with tinker_server.http("long") as http:
        session = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "t"})
        create = {"session_id": session.json()["session_id"], "sampling_session_seq_id": 0, "base_model": TINY}
        sampler = http.post("/api/v1/create_sampling_session", json=create).json()["sampling_session_id"]

        started = time.monotonic()
        [reference] = wait_all((http, _long_sample(http, sampler, 0)))
        long_s = time.monotonic() - started

        interleaved = http.get("/api/v1/usage").json()["interleaved_requests"]
        running = _long_sample(http, sampler, 1)
        contended_s = step()
        assert http.get("/api/v1/usage").json()["pending_requests"] == 1, "the long request ended first"
        [result] = wait_all((http, running))
        assert http.get("/api/v1/usage").json()["interleaved_requests"] >= interleaved + 2
    assert result["sequences"] == reference["sequences"]  # the training between its steps changed none of its tokens
    assert contended_s < long_s / 2, (alone_s, contended_s, long_s)
    service.close("success").result()
