"""The Tinker API through the official SDK (``tinker`` 0.38, unmodified) against a real OpenTinker server on loopback,
on the tiny Llama: supervised and RL learning, bit-exact resume, tenants kept apart, bad requests answered in the
SDK's error form, back-pressure through the SDK's own signals, the registry path, and a dead client's session reaped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tinker
from fixtures.tinker import CACHE, MAX_MODELS, MAX_PENDING, SESSION_TIMEOUT_S, TINY, wait_all, wait_for
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

pytestmark = pytest.mark.slow

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun."


@pytest.fixture
def sdk(tinker_server):
    """``sdk(tenant)``: a ``tinker.ServiceClient`` of that tenant, closed after the test."""
    clients = []

    def make(tenant: str) -> tinker.ServiceClient:
        clients.append(tinker_server.service_client(tenant))
        return clients[-1]

    yield make
    for client in clients:
        client.close("success").result()


def _sft_datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": np.ones(len(tokens) - 1, np.float32)},
    )


def _train(training, batch, steps: int, lr: float = 1e-2) -> list[float]:
    losses = []
    for _ in range(steps):
        step = training.forward_backward(batch, "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=lr, grad_clip_norm=1.0))
        losses.append(step.result().metrics["loss:sum"])
        optim.result()
    return losses


def _tracked_run(client, experiment: str, model_id: str, steps: int, timeout: float = 30.0):
    """The client's MLflow run once ``steps`` optimiser steps are logged (the server writes in the background)."""
    deadline = time.monotonic() + timeout
    while True:
        found = client.get_experiment_by_name(experiment)
        runs = client.search_runs([found.experiment_id], f"tags.`tinker.model_id` = '{model_id}'") if found else []
        if runs and len(client.get_metric_history(runs[0].info.run_id, "train/loss")) >= steps:
            return client.get_run(runs[0].info.run_id)
        assert time.monotonic() < deadline, f"no run with {steps} steps for {model_id}"
        time.sleep(0.5)


def _logprobs(training, batch) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in training.forward(batch, "cross_entropy").result().loss_fn_outputs]


def test_supervised_steps_lower_the_loss_and_each_client_is_an_mlflow_run(tinker_server, sdk):
    from mlflow import MlflowClient

    training = sdk("sft").create_lora_training_client(base_model=TINY, rank=8, seed=0).result()
    info = training.get_info()
    assert info.model_data.model_name == TINY and info.lora_rank == 8 and info.model_id == training.model_id
    tokenizer = training.get_tokenizer()  # offline: get_info names the server's tokenizer folder
    tokens = tokenizer.encode(TEXT)
    batch = [_sft_datum(tokens), _sft_datum(tokens[5:])]
    before = _logprobs(training, batch)
    assert np.array_equal(before[0], _logprobs(training, batch)[0])  # forward alone changes nothing
    losses = _train(training, batch, 4)
    assert losses[-1] < 0.8 * losses[0], losses
    assert np.isclose(-sum(lp.sum() for lp in before), losses[0], rtol=1e-4)
    assert before[1].shape == (len(tokens) - 6,)

    client = MlflowClient(tinker_server.tracking_uri("sft"))
    run = _tracked_run(client, "tenant-sft", training.model_id, steps=4)
    history = [m.value for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert history == pytest.approx(losses, rel=1e-5)
    assert run.data.params["lora_rank"] == "8"
    assert run.data.metrics["train/tokens_per_s"] > 0

    def custom(data, logprobs):  # forward_backward_custom runs client-side: a forward, then a weighted CE backward
        loss = sum(-lp.sum() for lp in logprobs)
        return loss, {"custom/nll:sum": float(loss)}

    custom_out = training.forward_backward_custom(batch, custom).result()
    plain = training.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    assert custom_out.metrics["loss:sum"] == pytest.approx(plain, rel=1e-5)


def test_an_rl_loop_raises_a_verifier_reward(sdk):
    """sample -> reward -> importance_sampling: the reward is the share of capital letters in a 4-token reply.

    At 5e-2 one seed in six collapsed within 10 steps onto one reply per prompt (every advantage 0, no more data);
    at 2e-2 fourteen seeds rose by 0.19 or more (first five steps' mean to last five's)."""
    training = sdk("rl").create_lora_training_client(base_model=TINY, rank=8, seed=0).result()
    tokenizer = training.get_tokenizer()
    prompts = [tokenizer.encode(f"Shout {i}.") for i in range(4)]

    def reward(tokens: list[int]) -> float:
        letters = [c for c in tokenizer.decode(tokens) if c.isalpha()]
        return sum(c.isupper() for c in letters) / max(len(letters), 1)

    history = []
    for step in range(20):
        sampler = training.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=step)
        futures = [sampler.sample(types.ModelInput.from_ints(p), 8, params) for p in prompts]
        data, rewards = [], []
        for prompt, future in zip(prompts, futures):
            sequences = future.result().sequences
            scores = np.array([reward(s.tokens) for s in sequences])
            rewards.append(scores.mean())
            for sequence, advantage in zip(sequences, scores - scores.mean()):
                if advantage == 0:
                    continue
                full, n = prompt + sequence.tokens, len(sequence.tokens)
                pad = [0.0] * (len(prompt) - 1)
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={
                            "target_tokens": np.array(full[1:]),
                            "logprobs": np.array(pad + sequence.logprobs, np.float32),
                            "advantages": np.array(pad + [advantage / 32] * n, np.float32),
                        },
                    )
                )
        history.append(float(np.mean(rewards)))
        if data:
            step_future = training.forward_backward(data, "importance_sampling")
            training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
            assert step_future.result().loss_fn_outputs[0]["logprobs"].shape[0] == len(data[0].model_input.to_ints())
    assert np.mean(history[-5:]) > np.mean(history[:5]) + 0.1, history


def test_stable_reinforce_trains_on_what_the_sampler_recorded(sdk):
    """Sampled with ``record_stability_info``, each sequence has a ``sequence_id``; a datum naming it through its
    provenance trains with ``stable_reinforce`` against the logprobs the server recorded (the client's are ignored),
    and only inside the session that sampled it."""
    service = sdk("stable")
    training = service.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    prompt = training.get_tokenizer().encode(TEXT)[:6]
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    params = types.SamplingParams(max_tokens=4, seed=3, stop=[])
    sequence = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result().sequences[0]
    assert sequence.sequence_id and len(sequence.tokens) == 4
    full, n = prompt + list(sequence.tokens), len(prompt) + 3
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(full[1:]),
            "logprobs": np.zeros(n, np.float32),  # wrong on purpose: the recorded ones are used
            "advantages": np.ones(n, np.float32),  # prompt positions' are zeroed
        },
    ).with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sequence.sequence_id, length=6),
            types.SampledProvenanceSpan(sequence_id=sequence.sequence_id, length=3),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sequence.sequence_id, offset=1, length=5),
            types.SampledProvenanceSpan(sequence_id=sequence.sequence_id, length=4),
        ],
    )
    step = training.forward_backward([datum], "stable_reinforce").result()
    # Same weights as the sampler's: every ratio is 1, so the loss is minus the sampled tokens' advantages.
    assert step.metrics["loss:sum"] == pytest.approx(-4.0, rel=1e-3)
    assert training.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["grad_norm:mean"] > 0

    with pytest.raises(tinker.RequestFailedError, match="needs the datum's provenance"):
        training.forward_backward(
            [types.Datum(model_input=datum.model_input, loss_fn_inputs=datum.loss_fn_inputs)], "stable_reinforce"
        ).result()
    other = sdk("stable").create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    with pytest.raises(tinker.RequestFailedError, match="not sampled with record_stability_info in this session"):
        other.forward_backward([datum], "stable_reinforce").result()


def test_clients_training_at_once_get_the_step_each_would_get_alone(tinker_server, sdk):
    """Two clients' ``forward_backward`` queued together (behind a long sampling request) run in one pass on the
    worker; each client's adapter after the step equals that of a client that trained alone on the same data."""
    service = sdk("batched")
    clients = [service.create_lora_training_client(base_model=TINY, rank=4, seed=7).result() for _ in range(3)]
    alone, first, second = clients
    tokens = alone.get_tokenizer().encode(TEXT)
    batch, probe = [_sft_datum(tokens), _sft_datum(tokens[4:])], [_sft_datum(tokens[2:])]
    [alone_loss] = _train(alone, batch, 1)
    want = _logprobs(alone, probe)

    sampler = service.create_sampling_client(base_model=TINY).result()
    long_sample = {
        "sampling_session_id": sampler._sampling_session_id,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens[:4]}]},
        "sampling_params": {"max_tokens": 256, "stop": []},
        "num_samples": 8,
    }
    with tinker_server.http("batched") as http:
        before = http.get("/api/v1/usage").json()["forward_backward_batching"]
        busy = http.post("/api/v1/asample", json=long_sample).json()["request_id"]  # queued when this returns
        steps = [client.forward_backward(batch, "cross_entropy") for client in (first, second)]
        params = types.AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)
        optims = [client.optim_step(params) for client in (first, second)]
        wait_for(http, busy)
    assert [s.result().metrics["loss:sum"] for s in steps] == pytest.approx([alone_loss] * 2, rel=1e-5)
    for optim in optims:
        optim.result()
    for client in (first, second):
        assert all(np.allclose(a, b, atol=1e-4) for a, b in zip(want, _logprobs(client, probe)))
    with tinker_server.http("batched") as http:
        after = http.get("/api/v1/usage").json()["forward_backward_batching"]
    assert after["requests"] - before["requests"] > after["passes"] - before["passes"]  # two clients, fewer passes


def test_save_state_then_load_resumes_bit_exact(tinker_server, sdk):
    service = sdk("resume")
    training = service.create_lora_training_client(base_model=TINY, rank=8, seed=1).result()
    tokens = training.get_tokenizer().encode(TEXT)
    batch, probe = [_sft_datum(tokens)], [_sft_datum(tokens[3:])]
    _train(training, batch, 2, lr=5e-3)
    saved = training.save_state("half", ttl_seconds=3600).result().path
    assert saved == f"tinker://{training.model_id}/weights/half"
    _train(training, batch, 2, lr=5e-3)
    want = _logprobs(training, probe)

    resumed = service.create_training_client_from_state_with_optimizer(saved).result()
    assert resumed.get_info().lora_rank == 8
    _train(resumed, batch, 2, lr=5e-3)
    assert all(np.array_equal(a, b) for a, b in zip(want, _logprobs(resumed, probe)))

    with pytest.warns(FutureWarning):  # the SDK's deprecated in-place load, on the original client
        training.load_state_with_optimizer(saved).result()
    _train(training, batch, 2, lr=5e-3)
    assert all(np.array_equal(a, b) for a, b in zip(want, _logprobs(training, probe)))

    weights_only = service.create_training_client_from_state(saved).result()
    _train(weights_only, batch, 2, lr=5e-3)  # a fresh optimiser takes different steps
    assert not all(np.array_equal(a, b) for a, b in zip(want, _logprobs(weights_only, probe)))
    listed = tinker.RestClient(base_url=tinker_server.url, api_key=tinker_server.key("resume"))
    checkpoints = listed.list_checkpoints(training.model_id).result().checkpoints
    assert [c.tinker_path for c in checkpoints] == [saved] and checkpoints[0].expires_at is not None
    run = listed.get_training_run(training.model_id).result()
    assert run.last_checkpoint.tinker_path == saved and run.lora_rank == 8 and run.model_owner == "resume"
    assert listed.get_server_capabilities().result().supported_models[0].model_name == TINY
    session = training.model_id.split(":")[0]
    assert session in listed.list_sessions().result().sessions
    assert training.model_id in listed.get_session(session).result().training_run_ids
    admin = tinker.AdminClient(base_url=tinker_server.url, api_key=tinker_server.key("resume"))
    usage = admin.get_current_checkpoint_storage_usage().result().data
    assert [(u.org_user_urn, u.checkpoint_count) for u in usage] == [("tenant:resume", 1)] and usage[0].size_bytes > 0
    with pytest.warns(tinker.ExperimentalWarning), pytest.raises(tinker.NotFoundError):  # not served, as documented
        listed.search_sessions(types.SessionSearchRequest()).result()
    listed.set_checkpoint_ttl_from_tinker_path(saved, None).result()
    assert [c.expires_at for c in listed.list_user_checkpoints().result().checkpoints] == [None]
    listed.delete_checkpoint_from_tinker_path(saved).result()
    assert listed.list_checkpoints(training.model_id).result().checkpoints == []
    service.close("success").result()  # frees its three training clients: a fourth would wait (429)
    with pytest.raises(tinker.RequestFailedError, match="no such checkpoint"):
        sdk("resume").create_training_client_from_state(saved).result()


def test_a_training_run_and_its_metadata_outlive_its_session_until_its_checkpoints_expire(tinker_server, sdk):
    """The cookbook's resume reads the run's ``user_metadata`` (its renderer) after the session that trained it
    closed: the run is the database's, readable while it has a checkpoint that has not expired."""
    metadata = {"renderer_name": "role_colon"}
    service = sdk("history")
    training = service.create_lora_training_client(base_model=TINY, rank=4, seed=0, user_metadata=metadata).result()
    saved = training.save_state("kept", ttl_seconds=3600).result().path
    sampler_path = training.save_weights_for_sampler("kept").result().path
    unsaved = service.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    session_id = training.model_id.split(":")[0]
    service.close("success").result()

    rest = tinker.RestClient(base_url=tinker_server.url, api_key=tinker_server.key("history"))
    run = rest.get_training_run_by_tinker_path(saved).result()
    assert run.training_run_id == training.model_id and run.user_metadata == metadata
    assert run.last_checkpoint.tinker_path == saved and run.last_sampler_checkpoint.tinker_path == sampler_path
    assert run.lora_rank == 4 and run.base_model == TINY
    listed = [r.training_run_id for r in rest.list_training_runs().result().training_runs]
    assert listed == [training.model_id]  # the run without a checkpoint went with its session
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run(unsaved.model_id).result()
    session = rest.get_session(session_id).result()
    assert set(session.training_run_ids) == {training.model_id, unsaved.model_id}
    assert session_id in rest.list_sessions().result().sessions
    other = tinker.RestClient(base_url=tinker_server.url, api_key=tinker_server.key("beta"))
    with pytest.raises(tinker.NotFoundError):
        other.get_training_run_by_tinker_path(saved).result()

    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    rest.set_checkpoint_ttl_from_tinker_path(saved, 1).result()
    time.sleep(1.2)
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run_by_tinker_path(saved).result()


def test_search_checkpoints_and_each_checkpoints_base_model_over_http(tinker_server, sdk):
    """SDK 0.39's ``search_checkpoints`` (``POST checkpoints/search``, built from its API reference: the 0.38 SDK
    has no such call) and ``Checkpoint.base_model``, over HTTP; 0.38's types still read the answers."""
    training = sdk("search").create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    first = training.save_state("a", user_metadata={"stage": "sft"}).result().path
    second = training.save_state("b", user_metadata={"stage": "rl"}).result().path
    sampler = training.save_weights_for_sampler("c").result().path
    with tinker_server.http("search") as http, tinker_server.http("nosy") as nosy:

        def search(client=http, **body) -> dict:
            response = client.post("/api/v1/checkpoints/search", json=body)
            assert response.status_code == 200, response.text
            return response.json()

        def paths(**body) -> list[str]:
            return [c["tinker_path"] for c in search(**body)["checkpoints"]]

        everything = search()
        assert [c["tinker_path"] for c in everything["checkpoints"]] == [sampler, second, first]  # newest first
        assert everything["next_cursor"] is None
        assert {c["base_model"] for c in everything["checkpoints"]} == {TINY}
        assert paths(user_metadata={"stage": "rl"}) == [second]
        assert paths(checkpoint_type="sampler") == [sampler] and paths(checkpoint_type="external") == []
        assert paths(base_models=[TINY]) == [sampler, second, first] and paths(base_models=["tiny"]) == paths()
        assert paths(base_models=["Qwen/Qwen3-8B"]) == [] and paths(base_models=[]) == []
        assert paths(owner={"type": "accessible"}) == paths(owner={"type": "own"}) == paths()
        assert paths(owner={"type": "user", "owner_urns": ["someone-else"]}) == []
        page = search(limit=2)
        assert [c["tinker_path"] for c in page["checkpoints"]] == [sampler, second]
        rest = search(limit=2, cursor=page["next_cursor"])
        assert [c["tinker_path"] for c in rest["checkpoints"]] == [first] and rest["next_cursor"] is None
        assert search(nosy)["checkpoints"] == []  # another tenant's checkpoints are never found
        for bad, field in (
            ({"project_ids": ["p"]}, "project_ids"),
            ({"limit": 0}, "limit"),
            ({"owner_id": 1}, "owner_id"),
        ):
            response = http.post("/api/v1/checkpoints/search", json=bad)
            assert response.status_code == 400 and field in response.json()["detail"], response.text
        listed = http.get(f"/api/v1/training_runs/{training.model_id}/checkpoints").json()["checkpoints"]
        assert {c["base_model"] for c in listed} == {TINY}
        run = http.get(f"/api/v1/training_runs/{training.model_id}").json()
        assert run["last_checkpoint"]["base_model"] == TINY

    client = tinker.RestClient(base_url=tinker_server.url, api_key=tinker_server.key("search"))
    assert {c.tinker_path for c in client.list_user_checkpoints().result().checkpoints} == {first, second, sampler}
    assert client.get_training_run_by_tinker_path(first).result().last_sampler_checkpoint.tinker_path == sampler
    info = client.get_weights_info_by_tinker_path(first).result()
    assert info.base_model == TINY and info.lora_rank == 4 and info.train_mlp


def test_a_pulled_tokenizer_loads_offline_where_transformers_and_the_sdk_look(tinker_server, tmp_path):
    """``opentinker tinker pull-tokenizer MODEL`` fills a fresh HF_HOME from the server; then, with the hub off,
    ``AutoTokenizer.from_pretrained(MODEL)`` and the SDK's ``SamplingClient.get_tokenizer()`` load it."""
    from opentinker.agents.lm_policy import load_tokenizer

    env = {
        **os.environ,
        "TINKER_BASE_URL": tinker_server.url,
        "TINKER_API_KEY": tinker_server.key("tokenizers"),
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("HF_HUB_CACHE", None)
    cli = [str(Path(sys.executable).with_name("opentinker")), "tinker", "pull-tokenizer"]
    pulled = subprocess.run([*cli, TINY], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    assert (tmp_path / "hf" / "hub" / "models--opentinker--tiny-llama" / "refs" / "main").is_file()
    script = f"""
import json, tinker
from transformers import AutoTokenizer
plain = AutoTokenizer.from_pretrained({TINY!r}).encode({TEXT!r})
service = tinker.ServiceClient()
sdk = service.create_sampling_client(base_model={TINY!r}).get_tokenizer().encode({TEXT!r})
service.close("success").result()
print(json.dumps([plain, sdk]))
"""
    loaded = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    plain, sdk_tokens = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert plain == sdk_tokens == load_tokenizer(CACHE).encode(TEXT)
    missing = subprocess.run(
        [*cli, "Qwen/Qwen3-8B"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert missing.returncode == 1 and "not served here" in missing.stdout


def test_two_tenants_cannot_see_each_others_models_checkpoints_or_samplers(tinker_server, sdk):
    alpha = sdk("alpha")
    training = alpha.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    tokens = training.get_tokenizer().encode(TEXT)
    _train(training, [_sft_datum(tokens)], 1)
    state = training.save_state("mine").result().path
    weights = training.save_weights_for_sampler("mine").result().path
    sampler = alpha.create_sampling_client(model_path=weights).result()

    beta = sdk("beta")
    with pytest.raises(tinker.NotFoundError):
        beta.create_sampling_client(model_path=weights).result()
    with pytest.raises(tinker.NotFoundError):  # another tenant's run: 404, as for every other call, not an empty list
        tinker.RestClient(base_url=tinker_server.url, api_key=tinker_server.key("beta")).list_checkpoints(
            training.model_id
        ).result()
    with pytest.raises(tinker.RequestFailedError, match="no such checkpoint"):
        beta.create_training_client_from_state(state).result()
    with tinker_server.http("beta") as http, tinker_server.http("alpha") as owner:
        proto = forward_backward_request_to_proto(
            types.ForwardBackwardRequest(
                forward_backward_input=types.ForwardBackwardInput(data=[_sft_datum(tokens)], loss_fn="cross_entropy"),
                model_id=training.model_id,
                seq_id=99,
            )
        ).SerializeToString()
        headers = {"Content-Type": "application/x-protobuf"}
        assert http.post("/api/v1/forward_backward", content=proto, headers=headers).status_code == 404
        assert http.post("/api/v1/get_info", json={"model_id": training.model_id}).status_code == 404
        assert http.get(f"/api/v1/samplers/{sampler._sampling_session_id}").status_code == 404
        session_id = training.model_id.split(":")[0]
        assert http.post("/api/v1/session_heartbeat", json={"session_id": session_id}).status_code == 404
        assert http.get(f"/api/v1/training_runs/{training.model_id}/checkpoints").status_code == 404
        alpha_request = owner.post(
            "/api/v1/save_weights_for_sampler", json={"model_id": training.model_id, "path": "again", "seq_id": 0}
        ).json()["request_id"]
        assert http.post("/api/v1/retrieve_future", json={"request_id": alpha_request}).status_code == 404
        assert wait_for(owner, alpha_request)["path"].endswith("/sampler_weights/again")
        sample = {
            "sampling_session_id": sampler._sampling_session_id,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens[:4]}]},
            "sampling_params": {"max_tokens": 2},
        }
        assert http.post("/api/v1/asample", json=sample).status_code == 404


def test_bad_requests_get_the_sdks_error_and_the_server_keeps_serving(tinker_server, sdk):
    service = sdk("errors")
    training = service.create_lora_training_client(base_model=TINY, rank=4, seed=0).result()
    tokens = training.get_tokenizer().encode(TEXT)
    good = _sft_datum(tokens)
    malformed = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": np.array(tokens[2:])}
    )
    too_long = _sft_datum(list(range(100, 2200)))
    cases = [
        ([malformed], "cross_entropy", "target_tokens']: expected shape"),
        ([good], "hinge", "'hinge' is not supported by this server"),
        ([good], "importance_sampling", "missing logprobs, advantages"),
        ([too_long], "cross_entropy", "longer than the model's context of 2048"),
    ]
    for data, loss, message in cases:
        with pytest.raises(tinker.RequestFailedError, match=message) as caught:
            training.forward_backward(data, loss).result()
        assert caught.value.category == types.RequestErrorCategory.User
    sampler = service.create_sampling_client(base_model=TINY).result()
    prompt = types.ModelInput.from_ints(tokens[:5])
    for stop, message in (([""], "stop strings must be 1-256 characters"), ([10**9], "token id 1000000000")):
        with pytest.raises(tinker.RequestFailedError, match=message):
            sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, stop=stop)).result()
    with tinker_server.http("errors") as http:
        garbage = http.post("/api/v1/forward_backward", content=b"\xff" * 64, headers={"Content-Type": "x"})
        assert garbage.status_code == 400 and "protobuf" in garbage.json()["detail"]
        assert http.post("/api/v1/create_model", json={"session_id": 1}).status_code == 400
    assert _train(training, [good], 1)[0] > 0  # the same client keeps working
    sequence = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=6, stop=[tokens[7]], seed=3)).result()
    assert len(sequence.sequences) == 2 and all(len(s.tokens) <= 6 for s in sequence.sequences)
    scored = sampler.compute_logprobs(prompt).result()  # the prompt's own logprobs, nothing before its first token
    assert scored[0] is None and len(scored) == 5 and all(lp < 0 for lp in scored[1:])


def test_back_pressure_speaks_the_sdks_signals(tinker_server):
    """429 with ``Retry-After`` over the training-client and in-flight limits, ``paused_capacity`` behind others."""

    def session(client) -> str:
        body = {"tags": [], "user_metadata": None, "sdk_version": "test"}
        return client.post("/api/v1/create_session", json=body).json()["session_id"]

    def create(client, session_id: str, seq: int):
        body = {"session_id": session_id, "model_seq_id": seq, "base_model": TINY, "lora_config": {"rank": 4}}
        return client.post("/api/v1/create_model", json=body)

    with tinker_server.http("busy") as http, tinker_server.http("queued") as other:
        mine = session(http)
        models = [create(http, mine, i).json() for i in range(MAX_MODELS)]
        assert create(http, mine, 0).json() == models[0]  # re-sent (a lost answer): the first sending's future
        over = create(http, mine, MAX_MODELS)
        assert over.status_code == 429 and "tinker_max_models_per_tenant" in over.json()["detail"]
        assert float(over.headers["Retry-After"]) > 0  # the SDK waits for a slot rather than failing
        for model in models:
            wait_for(http, model["request_id"])

        sampler = http.post(
            "/api/v1/create_sampling_session",
            json={"session_id": mine, "sampling_session_seq_id": 0, "base_model": TINY},
        ).json()["sampling_session_id"]
        long_sample = {
            "sampling_session_id": sampler,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "sampling_params": {"max_tokens": 400, "stop": [], "seed": 0},
            "num_samples": 32,
        }
        busy = http.post("/api/v1/asample", json={**long_sample}).json()
        theirs = session(other)
        their_sampler = other.post(
            "/api/v1/create_sampling_session",
            json={"session_id": theirs, "sampling_session_seq_id": 0, "base_model": TINY},
        ).json()["sampling_session_id"]
        too_wide = {  # more rows than fit beside the running pass's (tinker_sample_batch_rows): it waits for its end
            **long_sample,
            "sampling_session_id": their_sampler,
            "num_samples": 40,
            "sampling_params": {"max_tokens": 1},
        }
        waiting = other.post("/api/v1/asample", json=too_wide).json()
        pending = other.post("/api/v1/retrieve_future", json={"request_id": waiting["request_id"]})
        assert pending.status_code == 408, pending.text
        state = pending.json()
        assert state["queue_state"] == "paused_capacity" and "other clients" in state["queue_state_reason"]
        assert other.get("/api/v1/usage").json()["pending_requests"] == 1
        theirs_done, done = wait_all((other, waiting["request_id"]), (http, busy["request_id"]))
        assert len(theirs_done.get("sequences", [])) == 40 and len(done.get("sequences", [])) == 32, done

        # requests waiting for an earlier sequence number are in flight without costing the worker anything
        step = {"model_id": models[0]["model_id"], "adam_params": {"learning_rate": 1e-3}}
        held = [http.post("/api/v1/optim_step", json={**step, "seq_id": 10 + i}) for i in range(MAX_PENDING)]
        assert all(r.status_code == 200 for r in held)
        refused = http.post("/api/v1/optim_step", json={**step, "seq_id": 100})
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
        assert "tinker_max_pending_per_tenant" in refused.json()["detail"]

        http.post(f"/api/v1/sessions/{mine}/finish", json={"reason": {"type": "success"}})
        assert "finished" in wait_for(http, held[0].json()["request_id"])["error"]  # the held requests fail
        usage = http.get("/api/v1/usage").json()
        assert usage["training_clients"] == 0 and usage["pending_requests"] == 0
        assert http.post("/api/v1/session_heartbeat", json={"session_id": mine}).status_code == 410
        other.post(f"/api/v1/sessions/{theirs}/finish", json={"reason": {"type": "success"}})


def test_a_sampler_checkpoint_registers_and_serves_through_the_agent_path(tinker_server, sdk, monkeypatch):
    from typer.testing import CliRunner

    from opentinker.agents.lm_policy import load_adapted_model
    from opentinker.cli import app
    from opentinker.infra.settings import get_settings
    from opentinker.tracking.llm_store import download_adapter

    service = sdk("registry")
    training = service.create_lora_training_client(base_model=TINY, rank=4, seed=2).result()
    tokens = training.get_tokenizer().encode(TEXT)
    _train(training, [_sft_datum(tokens)], 2)
    path = training.save_weights_for_sampler("final").result().path
    cli = CliRunner()
    args = ["tinker", "register", path, "--name", "shouter", "--alias", "champion"]
    env = {"TINKER_BASE_URL": tinker_server.url, "TINKER_API_KEY": tinker_server.key("registry")}
    registered = cli.invoke(app, args, env=env)
    assert registered.exit_code == 0, registered.output
    assert (
        "models:/registry.shouter/1" in registered.output and "models:/registry.shouter@champion" in registered.output
    )
    refused = cli.invoke(app, [*args[:2], path.replace("sampler_weights", "weights"), *args[3:]], env=env)
    assert refused.exit_code == 1 and "error: 404" in refused.output  # no such checkpoint: it was never saved
    monkeypatch.setenv("OPENTINKER_MLFLOW_TRACKING_URI", tinker_server.tracking_uri("registry"))
    get_settings.cache_clear()
    try:
        ref, folder = download_adapter("models:/registry.shouter@champion")  # what `agent serve --llm` resolves
        model, _, meta = load_adapted_model(folder)
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
    assert ref.version == "1" and meta["base_model"] == "tiny" and meta["tinker_model_id"] == training.model_id
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0]
    served = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1)
    assert np.allclose(served.numpy(), _logprobs(training, [_sft_datum(tokens)])[0], atol=1e-4)


def test_a_session_whose_heartbeats_stop_is_reaped_and_its_memory_freed(tinker_server):
    """The orphan the fixture left at start (a session and a model, no heartbeats): gone within the timeout."""
    orphan = tinker_server.orphan
    deadline = orphan["created"] + SESSION_TIMEOUT_S + 15
    with tinker_server.http("orphan") as http:
        while time.monotonic() < deadline:
            if http.get(f"/api/v1/sessions/{orphan['session_id']}").json()["status"] == "expired":
                break
            time.sleep(0.5)
        assert http.get(f"/api/v1/sessions/{orphan['session_id']}").json()["status"] == "expired"
        assert http.post("/api/v1/get_info", json={"model_id": orphan["model_id"]}).status_code == 404
        assert http.post("/api/v1/session_heartbeat", json={"session_id": orphan["session_id"]}).status_code == 410
        assert http.get("/api/v1/usage").json()["training_clients"] == 0


LEAVER = """
import sys, tinker
service = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
for _ in range(int(sys.argv[3])):
    service.create_lora_training_client(base_model=sys.argv[4], rank=4).result()
"""


def test_a_client_that_exits_without_closing_frees_its_slots_for_the_next_one(tinker_server, sdk):
    """A script that holds the tenant's every training client and exits without ``close`` (the cookbook's recipes
    do): the next script's ``create_lora_training_client`` waits (429, ``Retry-After``) until that session is reaped,
    then succeeds, rather than failing."""
    args = [tinker_server.url, tinker_server.key("leaver"), str(MAX_MODELS), TINY]
    left = subprocess.run([sys.executable, "-c", LEAVER, *args], capture_output=True, text=True, timeout=300)
    assert left.returncode == 0, left.stderr[-3000:]
    started = time.monotonic()
    service = sdk("leaver")
    training = service.create_lora_training_client(base_model=TINY, rank=4).result()
    assert training.get_info().lora_rank == 4 and time.monotonic() - started < SESSION_TIMEOUT_S + 60
    service.close("success").result()
