"""The Tinker engine outlives the API process: ``opentinker server up`` killed with SIGKILL mid-loop and started again
on the same data dir, and the same SDK client objects (``tinker`` 0.38, unmodified) go on, with the losses of a run
that was never interrupted; two API processes on one data dir serve one client alternately; a killed engine fails
its clients' requests with the SDK's error (a request it held too, naming the checkpoint to resume from) and a new
one serves new clients. A server of its own (the shared one's short session timeout would reap the clients while the
API is down), on the tiny Llama; the tests run in order."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import psutil
import pytest
import tinker
from fixtures.tinker import TINY, TinkerServer, engine_pid, own_tinker_server, wait_for
from tinker import types

pytestmark = pytest.mark.slow

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun."
PARAMS = types.AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> TinkerServer:
    env = {
        "OPENTINKER_TINKER_SESSION_TIMEOUT_S": "600",  # no heartbeat reaches the engine while the API is down
    }
    with own_tinker_server(tmp_path_factory.mktemp("tinker-restart"), env) as server:
        yield server


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": np.ones(len(tokens) - 1, np.float32)},
    )


def _step(training, batch) -> float:
    loss = training.forward_backward(batch, "cross_entropy")
    optim = training.optim_step(PARAMS)
    value = loss.result().metrics["loss:sum"]
    optim.result()
    return value


def test_the_same_clients_go_on_after_the_api_is_killed_and_restarted(server):
    steady = server.service_client("steady").create_lora_training_client(base_model=TINY, rank=4, seed=3).result()
    service = server.service_client("restarted")
    training = service.create_lora_training_client(base_model=TINY, rank=4, seed=3).result()
    tokens = training.get_tokenizer().encode(TEXT)
    batch = [_datum(tokens)]
    want = [_step(steady, batch) for _ in range(5)]

    losses = [_step(training, batch) for _ in range(2)]
    in_flight = training.forward_backward(batch, "cross_entropy")  # sent before the kill, polled across it
    server.handle.kill()
    sent_while_down = training.optim_step(PARAMS)  # the SDK retries it until the new API answers
    server.handle.restart()
    losses.append(in_flight.result().metrics["loss:sum"])
    sent_while_down.result()
    losses += [_step(training, batch) for _ in range(2)]
    assert losses == want  # bit-exact: the engine, its adapters and optimiser states never stopped

    sampler = training.save_weights_and_get_sampling_client().result()
    sample = sampler.sample(types.ModelInput.from_ints(tokens[:4]), 1, types.SamplingParams(max_tokens=4)).result()
    assert len(sample.sequences[0].tokens) == 4
    rest = tinker.RestClient(base_url=server.url, api_key=server.key("restarted"))
    assert rest.get_training_run(training.model_id).result().training_run_id == training.model_id
    service.close("success").result()


def test_two_api_processes_on_one_data_dir_serve_one_client_alternately(server, tmp_path):
    """Each call of one client goes to the other API (as behind a load balancer): both reach the same engine; the
    second stopping normally leaves the engine to the first."""
    from opentinker.server.launcher import start_server

    second = start_server(tmp_path / "second.log", jobs=False, env=server.handle.env)
    try:
        apis = [server.http("alternating"), server.http("alternating")]
        apis[1].base_url = second.url
        calls = iter(apis * 8)
        opening = {"tags": [], "user_metadata": None, "sdk_version": "test"}
        session = next(calls).post("/api/v1/create_session", json=opening).json()
        body = {"session_id": session["session_id"], "model_seq_id": 0, "base_model": TINY, "lora_config": {"rank": 4}}
        created = next(calls).post("/api/v1/create_model", json=body).json()
        assert wait_for(next(calls), created["request_id"])["model_id"] == created["model_id"]
        step = {"model_id": created["model_id"], "adam_params": {"learning_rate": 1e-3}}
        for seq_id in (1, 2):
            sent = next(calls).post("/api/v1/optim_step", json={**step, "seq_id": seq_id}).json()
            again = next(calls).post("/api/v1/optim_step", json={**step, "seq_id": seq_id}).json()
            assert again == sent  # re-sent to the other API: the same future
            assert "metrics" in wait_for(next(calls), sent["request_id"])
        heartbeat = next(calls).post("/api/v1/session_heartbeat", json={"session_id": session["session_id"]})
        assert heartbeat.status_code == 200
        finish = next(calls).post(f"/api/v1/sessions/{session['session_id']}/finish", json={})
        assert finish.status_code == 200
        assert next(calls).get(f"/api/v1/sessions/{session['session_id']}").json()["status"] == "finished"
        for api in apis:
            api.close()
    finally:
        os.kill(second.pid, signal.SIGTERM)  # a normal stop, as a service manager's: the API's own shutdown
        assert second.exit_code(timeout=60) is not None  # uvicorn re-raises the signal once stopped
    # It did not start the engine's Ray head, so it left the head, its record and the engine to the other API.
    state = json.loads((server.handle.data_dir / "server" / "ray" / "state.json").read_text())
    assert psutil.Process(state["nodes"]["head"]["pid"]).is_running()
    assert server.http("alternating").get("/api/v1/sessions/" + session["session_id"]).status_code == 200


def _engine_process(server: TinkerServer) -> psutil.Process:
    """The engine actor's process (Ray's answer), under the local Ray head the server started for its data dir."""
    state = json.loads((server.handle.data_dir / "server" / "ray" / "state.json").read_text())
    tree = psutil.Process(state["nodes"]["head"]["pid"]).children(recursive=True)
    pid = engine_pid(server)
    assert pid in {process.pid for process in tree}, (pid, [(p.pid, p.name()) for p in tree])
    return psutil.Process(pid)


def _past_the_dead_engine(http, path: str, body: dict):
    """The first call that meets the dead engine answers 503 (the SDK retries) and the next one starts a new engine."""
    for _ in range(3):
        answer = http.post(path, json=body)
        if answer.status_code != 503:
            return answer
    raise AssertionError(f"{path} still 503 after a new engine should have started: {answer.text}")


def test_a_killed_engine_fails_its_clients_with_the_sdks_error_and_a_new_one_serves(server):
    doomed = server.service_client("doomed").create_lora_training_client(base_model=TINY, rank=4, seed=1).result()
    batch = [_datum(doomed.get_tokenizer().encode(TEXT))]
    _step(doomed, batch)
    saved = doomed.save_state("kept").result().path
    with server.http("doomed") as http:  # a request held by the engine: it waits for an earlier sequence number
        step = {"model_id": doomed.model_id, "adam_params": {"learning_rate": 1e-3}, "seq_id": 1000}
        held = http.post("/api/v1/optim_step", json=step).json()["request_id"]
        assert http.post("/api/v1/retrieve_future", json={"request_id": held}).status_code == 408
        engine = _engine_process(server)
        engine.kill()
        engine.wait(30)
        # the engine took it along: it failed (the SDK raises RequestFailedError), naming what to resume from
        answer = _past_the_dead_engine(http, "/api/v1/retrieve_future", {"request_id": held})
        assert answer.status_code == 200 and answer.json()["category"] == "server", answer.text
        assert "engine holding it stopped" in answer.json()["error"] and saved in answer.json()["error"]
        unknown = http.post("/api/v1/retrieve_future", json={"request_id": "req-" + "0" * 32})
        assert unknown.status_code == 404
    with server.http("other") as http:  # another tenant's request id stays unknown to it
        assert http.post("/api/v1/retrieve_future", json={"request_id": held}).status_code == 404
    with pytest.raises(tinker.NotFoundError, match="no longer served") as lost:  # its model went with the engine
        doomed.forward_backward(batch, "cross_entropy").result()
    assert saved in str(lost.value)  # the error names what to resume from
    fresh = server.service_client("after").create_lora_training_client(base_model=TINY, rank=4, seed=1).result()
    assert _step(fresh, batch) > 0
    assert _engine_process(server).pid != engine.pid
