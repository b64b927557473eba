"""The Tinker API's server side without a model: the wire format both ways on the SDK's own converters, the order a
model's requests run in, and the checkpoint store's paths, tenants and time-to-live."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from opentinker.agents.adapter_trainer import ForwardResult, TokenDatum
from opentinker.agents.lm_sampler import Completion, SampleResult
from opentinker.server.db import Store
from opentinker.server.errors import BadRequest
from opentinker.server.tinker import wire
from opentinker.server.tinker.futures import Future
from opentinker.server.tinker.sessions import Sequencer
from opentinker.server.tinker.stability import StabilityLog, resolve
from opentinker.server.tinker.store import CheckpointError, CheckpointNotFound, CheckpointPath, CheckpointStore


def _request(data, loss="importance_sampling", config=None) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss, loss_fn_config=config),
        model_id="s:train:0",
        seq_id=7,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def test_a_forward_backward_request_decodes_from_the_sdks_protobuf():
    import zstandard

    rl = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={
            "target_tokens": np.array([2, 3, 4]),
            "logprobs": np.array([-1.0, -2.0, -0.5], np.float32),
            "advantages": np.array([0.0, 1.5, -1.0], np.float32),
        },
    )
    body = _request([rl], "ppo", {"clip_low_threshold": 0.7})
    for encoded, encoding in ((body, None), (zstandard.ZstdCompressor().compress(body), "zstd")):
        call = wire.decode_forward_backward(encoded, encoding)
        assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("s:train:0", 7, "ppo", False)
        assert call.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7)}
        datum = call.data[0]
        assert list(datum.tokens) == [1, 2, 3] and datum.inputs["target_tokens"].tolist() == [2, 3, 4]
        assert datum.inputs["advantages"].dtype == np.float32 and datum.inputs["advantages"][1] == 1.5
    distill = types.Datum(  # (N, K) targets, sent sparse by the SDK
        model_input=types.ModelInput.from_ints([5, 6]),
        loss_fn_inputs={
            "target_tokens": torch.tensor([[7, 0, 0, 0], [0, 0, 0, 9]]),
            "weights": torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0.5]]),
        },
    )
    dense = wire.decode_forward_backward(_request([distill], "cross_entropy")).data[0]
    assert dense.inputs["target_tokens"].tolist() == [[7, 0, 0, 0], [0, 0, 0, 9]]
    assert dense.inputs["weights"][1, 3] == np.float32(0.5)


@pytest.mark.parametrize(
    ("body", "message"),
    [(b"\xff" * 40, "not a tinker ForwardBackwardRequest"), (b"", "model_id: required")],
)
def test_an_undecodable_body_is_named(body, message):
    with pytest.raises(wire.WireError, match=message):
        wire.decode_forward_backward(body)


def test_results_encode_to_what_the_sdks_decoders_read():
    result = ForwardResult([np.array([-1.0, -2.5], np.float32), np.zeros((3, 2), np.float32)], loss=3.5, tokens=5)
    output = deserialize_forward_backward_output(wire.forward_backward_proto(result, {"loss:sum": 3.5}))
    assert output.metrics == {"loss:sum": 3.5}
    assert output.loss_fn_outputs[0]["logprobs"].to_numpy().tolist() == [-1.0, -2.5]
    assert output.loss_fn_outputs[1]["logprobs"].shape == [3, 2]
    sampled = SampleResult(
        [Completion([5, 2], [-0.5, -0.25], [([5, 7], [-0.5, -1.0]), ([2, 3], [-0.25, -3.0])], "stop")],
        prompt_logprobs=np.array([np.nan, -1.5], np.float32),
    )
    response = deserialize_sample_response(wire.sample_proto(sampled))
    sequence = response.sequences[0]
    assert sequence.tokens == [5, 2] and sequence.logprobs == [-0.5, -0.25] and sequence.stop_reason == "stop"
    assert sequence.topk_logprobs[1] == [(2, -0.25), (3, -3.0)]
    assert response.prompt_logprobs == [None, -1.5]


def test_stop_sequences_take_each_form_the_sdk_sends():
    spec = wire.sampling_spec(types.SamplingParams(max_tokens=4, stop="\n\n"))
    assert spec.stop_strings == ("\n\n",) and spec.stop_at_eos
    spec = wire.sampling_spec(types.SamplingParams(max_tokens=4, stop=[7, 9]))
    assert spec.stop_tokens == (7, 9) and spec.stop_at_eos
    assert not wire.sampling_spec(types.SamplingParams(max_tokens=4, stop=[])).stop_at_eos
    with pytest.raises(wire.WireError, match="max_tokens: required"):
        wire.sampling_spec(types.SamplingParams())


def test_a_models_requests_run_in_sequence_order_once_each():
    ran: list[int] = []
    sequencer = Sequencer(gap_timeout=0.05)

    def offer(seq: int) -> Future:
        future = Future(f"r{seq}", "t", "k", "m", "s")
        sequencer.offer(seq, future, lambda: ran.append(seq))
        return future

    third = offer(3)
    offer(2)
    assert ran == []  # 1 has not arrived
    offer(1)
    assert ran == [1, 2, 3]
    assert sequencer.duplicate(3) is third and sequencer.duplicate(4) is None  # a re-sent request: its first answer
    with pytest.raises(BadRequest, match="seq_id: 2 was already used"):
        offer(2)
    offer(6)  # 4 and 5 never come
    sequencer.release_stalled(time.monotonic())
    assert ran == [1, 2, 3]
    time.sleep(0.1)
    sequencer.release_stalled(time.monotonic())
    offer(0)  # a request without a seq_id runs next
    assert ran == [1, 2, 3, 6, 0] and sequencer.next == 8


def test_checkpoints_belong_to_a_tenant_and_expire(tmp_path):
    db = Store(f"sqlite:///{tmp_path / 'server.db'}")
    store = CheckpointStore(lambda tenant: tmp_path / tenant, db)
    path = CheckpointPath.make("s:train:0", "weights", "step-1")
    fill = lambda folder: (folder / "state.pt").write_bytes(b"x" * 10)  # noqa: E731
    meta = store.write("acme", path, fill, "tiny", ttl_seconds=1)
    assert meta["tinker_path"] == "tinker://s:train:0/weights/step-1" and meta["size_bytes"] == 10
    assert meta["base_model"] == "tiny" and store.usage_bytes("acme") == 10
    assert store.open("acme", path.uri)[1].joinpath("state.pt").read_bytes() == b"x" * 10
    with pytest.raises(CheckpointNotFound):
        store.open("other", path.uri)  # another tenant's path is not found
    assert store.list("other") == [] and store.usage_bytes("other") == 0
    with pytest.raises(CheckpointError, match="already exists"):
        store.write("acme", path, lambda folder: None, "tiny")
    store.set_ttl("acme", path.uri, None)
    assert store.list("acme")[0]["expires_at"] is None
    # The records are the database's: a second store on the same database (another API process) sees them.
    assert CheckpointStore(lambda tenant: tmp_path / tenant, db).list("acme", "s:train:0")[0]["size_bytes"] == 10
    store.set_ttl("acme", path.uri, 1)
    time.sleep(1.1)
    with pytest.raises(CheckpointNotFound, match="expired"):
        store.open("acme", path.uri)
    assert store.usage_bytes("acme") == 0 and store.sweep() == 1
    assert not store.folder("acme", path).exists()
    for bad in ("tinker://x/other/y", "s3://bucket/key", "tinker://x/weights/../../etc"):
        with pytest.raises(CheckpointError):
            CheckpointPath.parse(bad)


def test_checkpoints_of_a_server_before_the_database_are_adopted(tmp_path):
    """A checkpoint folder with the ``checkpoint.json`` earlier servers wrote is recorded once, at start."""
    store = CheckpointStore(lambda tenant: tmp_path / "tenants" / tenant, Store(f"sqlite:///{tmp_path / 'db.sqlite'}"))
    path = CheckpointPath.make("s:train:0", "sampler_weights", "final")
    folder = store.folder("acme", path)
    folder.mkdir(parents=True)
    meta = {
        "tinker_path": path.uri,
        "time": "2026-12-01T00:00:00+00:00",
        "expires_at": None,
        "size_bytes": 7,
        "user_metadata": {"renderer_name": "role_colon"},
        "base_model": "tiny",
    }
    (folder / "checkpoint.json").write_text(json.dumps(meta))
    assert store.adopt(tmp_path / "tenants") == 1 and store.adopt(tmp_path / "tenants") == 0
    listed = store.list("acme")
    assert len(listed) == 1 and listed[0]["user_metadata"] == {"renderer_name": "role_colon"}
    assert listed[0]["checkpoint_type"] == "sampler" and store.usage_bytes("acme") == 7


def test_provenance_decodes_and_stable_reinforce_reads_the_recorded_logprobs():
    """A datum's provenance comes off the SDK's protobuf; ``resolve`` checks each run against the session's records
    and fills ``logprobs`` with the sampler's, zeroing advantages where the sampler produced nothing."""
    prompt, sampled, logprobs = [5, 6, 7], [8, 9], [-0.5, -1.5]
    log = StabilityLog()
    log.record(["req-1:0"], prompt, [Completion(tokens=sampled, logprobs=logprobs)])
    tokens = prompt + sampled  # the datum: input prompt + sampled[:-1], targets prompt[1:] + sampled
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "advantages": np.ones(4, np.float32)},
    ).with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id="req-1:0", length=3),
            types.SampledProvenanceSpan(sequence_id="req-1:0", length=1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id="req-1:0", offset=1, length=2),
            types.SampledProvenanceSpan(sequence_id="req-1:0", length=2),
        ],
    )
    call = wire.decode_forward_backward(_request([datum], loss="stable_reinforce"))
    assert call.provenance[0].loss_fn_inputs[1].sampled and call.provenance[0].loss_fn_inputs[1].length == 2
    [filled] = resolve(call.data, call.provenance, log)
    assert filled.inputs["logprobs"].tolist() == [0.0, 0.0, -0.5, -1.5]
    assert filled.inputs["advantages"].tolist() == [0.0, 0.0, 1.0, 1.0]

    plain = wire.decode_forward_backward(
        _request(
            [types.Datum(model_input=datum.model_input, loss_fn_inputs=datum.loss_fn_inputs)], loss="stable_reinforce"
        )
    )
    with pytest.raises(ValueError, match="needs the datum's provenance"):
        resolve(plain.data, plain.provenance, log)
    with pytest.raises(ValueError, match="was not sampled with record_stability_info in this session"):
        resolve(call.data, call.provenance, StabilityLog())  # another session's log
    wrong = TokenDatum(call.data[0].tokens, {**call.data[0].inputs, "target_tokens": np.array([6, 7, 8, 1])})
    with pytest.raises(ValueError, match=r"tokens 2\.\.4 are not positions 0\.\.2 of sequence 'req-1:0'"):
        resolve([wrong], call.provenance, log)


def test_a_pulled_tokenizer_lands_in_the_hub_cache_layout_and_bad_names_are_refused(tmp_path):
    from opentinker.cli.tinker import install_tokenizer

    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = install_tokenizer("org/name", revision, {"tokenizer.json": b"{}"}, tmp_path)
    assert snapshot == tmp_path / "models--org--name" / "snapshots" / revision
    assert (tmp_path / "models--org--name" / "refs" / "main").read_text() == revision
    assert (snapshot / "tokenizer.json").read_bytes() == b"{}"
    for files, rev in (({"../evil": b""}, revision), ({".hidden": b""}, revision), ({"a": b""}, "main")):
        with pytest.raises(ValueError):
            install_tokenizer("org/name", rev, files, tmp_path)
    assert sorted(p.name for p in (tmp_path / "models--org--name" / "snapshots").iterdir()) == [revision]


def test_the_worker_batches_clients_forward_backward_keeping_each_ones_order(monkeypatch):
    """A ``forward_backward`` at the head of the queue takes along the first queued one of each other client whose
    requests have nothing queued before it (same base model, same kind); everything else keeps its place."""
    import asyncio
    import threading

    from opentinker.server.tinker import engine as engine_module
    from opentinker.server.tinker.engine import TinkerEngine, TrainPart, Work
    from opentinker.server.tinker.futures import FutureStore, Outcome

    batches: list[list[str]] = []

    def fake_many(parts, forward_only):
        batches.append(list(parts))
        return [ForwardResult([], 0.0, 0) for _ in parts]

    monkeypatch.setattr(engine_module, "forward_backward_many", fake_many)
    futures = FutureStore(asyncio.new_event_loop())
    worker = TinkerEngine(futures, loader=None)
    gate = threading.Event()
    worker.call(gate.wait)  # holds the worker while the queue fills
    ran: list[str] = []

    def train(owner: str, tag: str, forward_only: bool = False) -> Work:
        part = TrainPart(prepare=lambda: tag, finish=lambda result, s: Outcome.of({}), forward_only=forward_only)
        return Work(futures.create("t", "ForwardBackward", owner, "s"), base="tiny", train=part)

    def other(owner: str, tag: str) -> Work:
        return Work(futures.create("t", "OptimStep", owner, "s"), run=lambda: ran.append(tag) or Outcome.of({}))

    queued = [
        train("A", "a1"),
        train("B", "b1"),
        train("A", "a2"),
        other("C", "c-optim"),
        train("C", "c1"),
        train("D", "d1", forward_only=True),
        train("B", "b2"),
        train("E", "e1"),
    ]
    for work in queued:
        worker.submit(work)
    gate.set()
    deadline = time.monotonic() + 10
    while worker.depth() and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.close()
    # a1 takes b1 and e1 (A's second is its own, C's waits behind C's step, D's is a forward); then a2 takes b2
    # (c1 still waits: C's step is queued after a2); then C's step, c1 and d1, each alone.
    assert batches == [["a1", "b1", "e1"], ["a2", "b2"], ["c1"], ["d1"]] and ran == ["c-optim"]


def _engine(monkeypatch, **options):
    """A worker on a stand-in model; ``forward_backward_many`` records each pass and takes 50 ms (its compute)."""
    import asyncio
    from types import SimpleNamespace

    from opentinker.server.tinker import engine as engine_module
    from opentinker.server.tinker.engine import TinkerEngine
    from opentinker.server.tinker.futures import FutureStore

    passes: list[list[str]] = []

    def fake_many(parts, forward_only):
        passes.append(list(parts))
        time.sleep(0.05)
        return [ForwardResult([], 0.0, 0) for _ in parts]

    monkeypatch.setattr(engine_module, "forward_backward_many", fake_many)
    futures = FutureStore(asyncio.new_event_loop())
    model = SimpleNamespace(base="tiny", vocab_size=100, max_context=64)
    return TinkerEngine(futures, loader=lambda base: model, **options), futures, passes


def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_forward_backward_waits_a_moment_for_the_clients_that_trained_on_its_model(monkeypatch):
    """A client whose forward_backward reaches the worker just after another's shares its pass: the first waits
    for each client that trained recently, until its request is queued (here long before the 2 s bound); a client
    that does not come costs one wait, then is no longer waited for."""
    from opentinker.server.tinker.engine import TrainPart, Work
    from opentinker.server.tinker.futures import Outcome

    worker, futures, passes = _engine(monkeypatch, gather_s=30.0, gather_share=40.0)  # 40 x a 50 ms pass: 2 s

    def train(owner: str, tag: str) -> Work:
        part = TrainPart(prepare=lambda: tag, finish=lambda result, s: Outcome.of({}))
        return Work(futures.create("t", "ForwardBackward", owner, "s"), base="tiny", train=part)

    try:
        for work in (train("A", "a1"), train("B", "b1")):
            worker.submit(work)
        _until(lambda: len(passes) == 1 and not worker.depth())
        early = train("A", "a2")
        started = time.monotonic()
        worker.submit(early)
        _until(lambda: worker.busy is early.future)  # the worker holds it: B's arrives after its pass would start
        worker.submit(train("B", "b2"))
        _until(lambda: len(passes) == 2 and not worker.depth())
        assert passes == [["a1", "b1"], ["a2", "b2"]] and time.monotonic() - started < 1.5
        worker.submit(train("A", "a3"))  # B stopped: one wait, about 2 s
        _until(lambda: len(passes) == 3 and not worker.depth())
        started = time.monotonic()
        worker.submit(train("A", "a4"))
        _until(lambda: len(passes) == 4 and not worker.depth())
        assert passes[2:] == [["a3"], ["a4"]] and time.monotonic() - started < 1.0
    finally:
        worker.close()


def test_sampling_requests_join_the_running_pass_from_the_head_of_the_queue(monkeypatch):
    """While a sampling pass decodes, sampling requests at the head of the queue join it (up to ``max_rows``); one
    that arrives behind another kind of request waits for the next pass."""
    import threading

    from opentinker.agents.lm_sampler import SampleJob, SamplingSpec
    from opentinker.server.tinker.engine import Work
    from opentinker.server.tinker.futures import Outcome

    passes: list[list[str]] = []

    def sample(owner: str, rows: int = 1) -> Work:
        job = SampleJob([1, 2], rows, SamplingSpec(max_tokens=2), adapter=owner)
        return Work(futures.create("t", "Sample", owner, "s"), job=job, base="tiny", encode=lambda r: Outcome.of({}))

    class Sampler:
        def __init__(self, model):
            pass

        def sample(self, jobs, join=None, done=None):
            jobs = list(jobs)
            for arriving in arrivals.pop(jobs[0].adapter, []):  # requests that arrive while this pass decodes
                worker.submit(arriving)
            jobs += join(sum(job.num_samples for job in jobs))
            passes.append([job.adapter for job in jobs])
            for index in range(len(jobs)):
                done(index, SampleResult([Completion()]))
            return [SampleResult([Completion()]) for _ in jobs]

    worker, futures, _ = _engine(monkeypatch, sampler=Sampler, max_rows=4)
    arrivals = {"A": [sample("B"), sample("C", 4)], "E": [sample("G")]}  # C does not fit beside A and B
    try:
        worker.submit(sample("A"))
        _until(lambda: len(passes) == 2 and not worker.depth())
        assert passes == [["A", "B"], ["C"]]
        gate = threading.Event()
        worker.call(gate.wait)
        worker.submit(sample("E"))
        worker.call(lambda: None)  # another kind of request: G, arriving behind it, does not join E's pass
        worker.submit(sample("F"))  # queued before the pass starts: in its batch
        gate.set()
        _until(lambda: len(passes) == 4 and not worker.depth())
        assert passes[2:] == [["E", "F"], ["G"]]
    finally:
        worker.close()


def test_a_long_sampling_pass_runs_the_waiting_work_between_its_decode_steps(monkeypatch):
    """Once a pass has held the worker ``slice_s``, waiting work runs between two of its decode steps (with autograd
    on, as a training pass needs), in queue order; a call that may drop an adapter, and a sampling request that does
    not fit beside the pass's rows, wait for the pass's end."""
    from opentinker.agents.lm_sampler import SampleJob, SamplingSpec
    from opentinker.server.tinker.engine import Work
    from opentinker.server.tinker.futures import Outcome

    events: list[str] = []

    def sample(owner: str, rows: int) -> Work:
        job = SampleJob([1, 2], rows, SamplingSpec(max_tokens=2), adapter=owner)
        return Work(
            futures.create(owner, "Sample", owner, owner), job=job, base="tiny", encode=lambda r: Outcome.of({})
        )

    def op(name: str) -> Work:
        def run() -> Outcome:
            events.append(f"{name} grad={torch.is_grad_enabled()}")
            return Outcome.of({})

        return Work(futures.create(name, "OptimStep", name, name), run=run)

    class Sampler:
        def __init__(self, model):
            pass

        @torch.no_grad()
        def sample(self, jobs, join=None, done=None):
            jobs = list(jobs)
            for _ in range(40):  # 40 decode steps of 10 ms
                time.sleep(0.01)
                jobs += join(sum(job.num_samples for job in jobs))
            events.append(f"{jobs[0].adapter} ended")
            for index in range(len(jobs)):
                done(index, SampleResult([Completion()]))
            return [SampleResult([Completion()]) for _ in jobs]

    worker, futures, _ = _engine(monkeypatch, sampler=Sampler, max_rows=4, slice_s=0.05)
    try:
        worker.submit(sample("A", 3))
        _until(lambda: worker.busy is not None)
        worker.submit(op("B"))
        worker.call(lambda: events.append("release"))  # may drop an adapter the pass reads
        worker.submit(sample("C", 2))  # 3 + 2 rows > max_rows: it cannot join
        worker.call(lambda: events.append("load"), interleave=True)  # adds an adapter: may run within the pass
        _until(lambda: "C ended" in events and not worker.depth())
        assert events == ["B grad=True", "load", "A ended", "release", "C ended"]
        assert worker.interleaved == 2
    finally:
        worker.close()
