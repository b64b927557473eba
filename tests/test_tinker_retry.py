"""Every Tinker call that creates or changes something is safe to re-send: the SDK (0.38) gives an HTTP call 60 s,
then sends the SAME request again (same session and sequence ids), so a re-send must get the first sending's answer
and have no effect of its own, whether the first is still queued or long done. And none of them waits on the engine:
``create_sampling_session`` answers at once even while another tenant's long sampling request holds the worker.

Raw HTTP with the SDK's own request types, on the shared tiny-model server (``fixtures.tinker``)."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
from fixtures.tinker import TINY, wait_all
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

pytestmark = pytest.mark.slow

TOKENS = list(range(100, 124))
HOG = {"max_tokens": 120, "stop": [], "seed": 0}
"""Another tenant's sampling request that keeps the one worker's sampling busy for seconds (32 rows of 120 tokens:
5-9 s on a loaded 2-core machine, where sending every call below takes well under one)."""
WIDE = 40
"""Rows of a sampling request that cannot join the long one's pass (32 + 40 > ``tinker_sample_batch_rows``, 64)."""


def _body(request) -> dict:
    """A request as the SDK puts it on the wire."""
    return request.model_dump(mode="json", exclude_none=True)


def _hog(http) -> str:
    """Another tenant's long sampling request, at the head of the worker's queue when this returns."""
    session = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "t"})
    create = types.CreateSamplingSessionRequest(
        session_id=session.json()["session_id"], sampling_session_seq_id=0, base_model=TINY
    )
    sampler = http.post("/api/v1/create_sampling_session", json=_body(create)).json()["sampling_session_id"]
    sample = types.SampleRequest(
        sampling_session_id=sampler,
        seq_id=0,
        num_samples=32,
        prompt=types.ModelInput.from_ints([1, 2, 3]),
        sampling_params=types.SamplingParams(**HOG),
    )
    return http.post("/api/v1/asample", json=_body(sample)).json()["request_id"]


def _busy(http) -> bool:
    """Whether the hog's request is still pending (so everything sent since is queued behind it)."""
    return http.get("/api/v1/usage").json()["pending_requests"] == 1


def test_every_create_or_change_call_sent_twice_has_one_effect_and_the_same_answer(tinker_server):
    with tinker_server.http("retry") as http, tinker_server.http("hog") as hog:

        def twice(route: str, body: dict | bytes) -> dict:
            """Sent, then re-sent at once (the first still queued): both answers equal."""
            if isinstance(body, bytes):
                headers = {"Content-Type": "application/x-protobuf"}
                send = functools.partial(http.post, f"/api/v1/{route}", content=body, headers=headers)
            else:
                send = functools.partial(http.post, f"/api/v1/{route}", json=body)
            first, again = send(), send()
            assert first.status_code == 200, (route, first.text)
            assert again.status_code == 200 and again.json() == first.json(), (route, again.text)
            sent.append((send, first.json()))
            return first.json()

        sent: list = []
        session = http.post(
            "/api/v1/create_session",
            json=_body(types.CreateSessionRequest(tags=[], user_metadata={}, sdk_version="t")),
        ).json()["session_id"]

        create = types.CreateModelRequest(
            session_id=session, model_seq_id=0, base_model=TINY, lora_config=types.LoraConfig(rank=4)
        )
        created = twice("create_model", _body(create))
        wait_all((http, created["request_id"]))

        # 1. each sent twice while queued: a sampling request too wide to join another tenant's long pass (it waits
        # for the pass's end), and a training client's every kind of call held behind the one it has not sent yet
        busy = _hog(hog)
        create_base = _body(
            types.CreateSamplingSessionRequest(session_id=session, sampling_session_seq_id=1, base_model=TINY)
        )
        base_sampler = twice("create_sampling_session", create_base)["sampling_session_id"]
        sample = types.SampleRequest(
            sampling_session_id=base_sampler,
            seq_id=0,
            num_samples=2,
            prompt=types.ModelInput.from_ints(TOKENS[:4]),
            sampling_params=types.SamplingParams(max_tokens=4, seed=1),
        )
        sampled = twice("asample", _body(sample.model_copy(update={"num_samples": WIDE})))
        model = created["model_id"]
        step = types.AdamParams(learning_rate=1e-2)
        load = types.LoadWeightsRequest(
            model_id=model, seq_id=5, path=f"tinker://{model}/weights/step-000001", optimizer=True
        )
        held = [
            twice("optim_step", _body(types.OptimStepRequest(adam_params=step, model_id=model, seq_id=2))),
            twice("save_weights", _body(types.SaveWeightsRequest(model_id=model, seq_id=3))),  # named by its step
            twice(
                "save_weights_for_sampler",
                _body(types.SaveWeightsForSamplerRequest(model_id=model, seq_id=4, path="r")),
            ),
            twice("load_weights", _body(load)),
            twice(
                "save_weights_for_sampler",
                _body(types.SaveWeightsForSamplerRequest(model_id=model, seq_id=6, sampling_session_seq_id=0)),
            ),
        ]
        assert http.get("/api/v1/usage").json()["pending_requests"] == len(held) + 1  # one future per call
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(TOKENS[:-1]),
            loss_fn_inputs={"target_tokens": np.array(TOKENS[1:]), "weights": np.ones(len(TOKENS) - 1, np.float32)},
        )
        fb = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
            model_id=model,
            seq_id=1,
        )
        futures = [twice("forward_backward", forward_backward_request_to_proto(fb).SerializeToString()), *held, sampled]
        assert _busy(hog), "the long request ended before every call was sent: make it longer"

        results = wait_all(*[(http, f["request_id"]) for f in futures], (hog, busy))[:-1]
        assert not [r for r in results if "error" in r], results
        assert results[2]["path"] == f"tinker://{model}/weights/step-000001"  # one optimiser step, not two

        # 2. every call sent again once done: the same answer, the same result, nothing run again
        for send, answer in sent:
            again = send()
            assert again.status_code == 200 and again.json() == answer, again.text
        assert wait_all(*[(http, f["request_id"]) for f in [created, *futures]])[1:] == results
        final = types.SaveWeightsRequest(model_id=model, seq_id=7, overwrite=True)
        saved = wait_all((http, http.post("/api/v1/save_weights", json=_body(final)).json()["request_id"]))[0]
        assert saved["path"] == f"tinker://{model}/weights/step-000001"  # still one step after the load

        # 3. a sampler on a checkpoint, created during another tenant's long pass: answered at once, its adapter
        # loaded on the worker after the answer, its first request waiting for that
        busy = _hog(hog)
        checkpoint = f"tinker://{model}/sampler_weights/r"
        create_loaded = _body(
            types.CreateSamplingSessionRequest(session_id=session, sampling_session_seq_id=2, model_path=checkpoint)
        )
        started = time.monotonic()
        loaded_sampler = twice("create_sampling_session", create_loaded)["sampling_session_id"]
        answered_s = time.monotonic() - started
        sampled = twice("asample", _body(sample.model_copy(update={"sampling_session_id": loaded_sampler})))
        assert _busy(hog), f"the long request ended before the sampler was created ({answered_s:.1f} s)"
        clash = {**create_base, "sampling_session_seq_id": 2}  # the same ids for another sampler: not a re-send
        assert http.post("/api/v1/create_sampling_session", json=clash).status_code == 400
        done, _ = wait_all((http, sampled["request_id"]), (hog, busy))
        assert len(done["sequences"]) == 2, done
        for send, answer in sent[-2:]:
            assert send().json() == answer

        info = http.get(f"/api/v1/sessions/{session}").json()
        assert info["training_run_ids"] == [model]
        assert sorted(info["sampler_ids"]) == sorted([f"{session}:sample:0", base_sampler, loaded_sampler])
        listed = http.get(f"/api/v1/training_runs/{model}/checkpoints").json()["checkpoints"]
        assert sorted(c["tinker_path"] for c in listed) == [checkpoint, f"tinker://{model}/weights/step-000001"]
        usage = http.get("/api/v1/usage").json()
        assert usage["training_clients"] == 1 and usage["samplers"] == 3 and usage["pending_requests"] == 0
        http.post(f"/api/v1/sessions/{session}/finish", json={"reason": {"type": "success"}})
