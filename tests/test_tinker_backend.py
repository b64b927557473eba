"""The Tinker API's model side, in-process on the tiny Llama: the five losses, many LoRA adapters on one base model,
AdamW steps, bit-exact state, and the batched KV-cache sampler (seeds, stops, logprobs that match training's)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from opentinker.agents.adapter_trainer import AdamStep, AdapterTrainer, TokenDatum
from opentinker.agents.grpo import token_loss as grpo_token_loss
from opentinker.agents.lm_sampler import HFSampler, SampleJob, SamplingError, SamplingSpec
from opentinker.agents.multi_lora import AdapterShape, MultiLoraModel
from opentinker.agents.token_losses import LOSSES, LossInputError, check_config, check_datum

CACHE = str(Path(tempfile.gettempdir()) / "opentinker-test-llm-cache")  # shared with the other LLM tests
SEQUENCE = list(range(100, 140))


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return MultiLoraModel("tiny", CACHE)


def _datum(tokens=SEQUENCE, **inputs) -> TokenDatum:
    n = len(tokens) - 1
    return TokenDatum(tokens[:-1], {"target_tokens": np.array(tokens[1:]), **{k: v[:n] for k, v in inputs.items()}})


def _logprobs(model, name, tokens=SEQUENCE) -> torch.Tensor:
    with torch.no_grad():
        return model.target_logprobs(name, [tokens[:-1]], [torch.tensor(tokens[1:])])[0]


def test_each_loss_has_the_value_and_gradient_of_its_formula():
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0], requires_grad=True)
    q = torch.tensor([-1.2, -1.0, -0.5, -3.5])
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])
    inputs = {"logprobs": q, "advantages": adv, "weights": torch.tensor([1.0, 0.0, 2.0, 1.0])}
    ratio = torch.exp(logp.detach() - q)
    expected = {  # loss value, d loss / d logp
        "cross_entropy": (-(inputs["weights"] * logp.detach()).sum(), -inputs["weights"]),
        "importance_sampling": (-(ratio * adv).sum(), -ratio * adv),
        "cispo": (-(ratio.clamp(0.0, 4.0) * logp.detach() * adv).sum(), -ratio.clamp(0.0, 4.0) * adv),
        "dro": (-(logp.detach() * adv - 0.025 * (logp.detach() - q) ** 2).sum(), -(adv - 0.05 * (logp.detach() - q))),
    }
    clipped = ratio.clamp(0.8, 1.2)
    unclipped_is_min = ratio * adv <= clipped * adv
    expected["ppo"] = (-torch.min(ratio * adv, clipped * adv).sum(), torch.where(unclipped_is_min, -ratio * adv, 0.0))
    expected["stable_reinforce"] = expected["ppo"]  # on the logprobs the server recorded (stability.resolve)
    for name, spec in LOSSES.items():
        logp.grad = None
        used = {k: v for k, v in inputs.items() if k in spec.required + spec.optional}
        loss = spec.fn(logp, used, check_config(name, None)).sum()
        loss.backward()
        value, grad = expected[name]
        assert torch.allclose(loss.detach(), value), name
        assert torch.allclose(logp.grad, grad), name
    # The built-in GRPO's surrogate is the same clipped ratio (one function): without KL it is ppo's loss.
    per_token, _ = grpo_token_loss(logp.detach(), q, None, adv, 0.2, 0.0)
    assert torch.allclose(per_token.sum(), expected["ppo"][0])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: check_config("gspo", None), "'gspo' is not supported by this server"),
        (
            lambda: check_config("hinge", None),
            "supported: cross_entropy, importance_sampling, ppo, cispo, dro, stable_reinforce",
        ),
        (lambda: check_config("ppo", {"beta": 0.1}), "loss_fn_config['beta']: not a parameter of ppo"),
        (lambda: check_config("dro", {"beta": "x"}), "expected a finite number"),
        (lambda: check_config("ppo", {"clip_low_threshold": 1.1}), "clip_low_threshold <= 1"),
        (lambda: check_datum("ppo", 0, 3, {"target_tokens": np.arange(3)}, 50), "missing logprobs, advantages"),
        (
            lambda: check_datum("cross_entropy", 2, 3, {"target_tokens": np.arange(3), "mask": np.ones(3)}, 50),
            "data[2].loss_fn_inputs['mask']: not an input of cross_entropy",
        ),
        (lambda: check_datum("cross_entropy", 0, 4, {"target_tokens": np.arange(3)}, 50), "expected shape (4,)"),
        (lambda: check_datum("cross_entropy", 0, 3, {"target_tokens": np.array([1, 2, 99])}, 50), "[0, 50)"),
        (
            lambda: check_datum(
                "importance_sampling",
                0,
                3,
                {
                    "target_tokens": np.arange(3),
                    "logprobs": np.zeros(2, np.float32),
                    "advantages": np.zeros(3, np.float32),
                },
                50,
            ),
            "['logprobs']: expected the shape of target_tokens (3,)",
        ),
    ],
)
def test_a_bad_loss_request_names_the_field(call, message):
    with pytest.raises(LossInputError) as caught:
        call()
    assert message in str(caught.value)


def test_cross_entropy_steps_lower_the_loss_on_a_fixed_batch(model):
    trainer = AdapterTrainer(model, "sft", AdapterShape(rank=8), seed=0)
    try:
        batch = [_datum(), _datum(SEQUENCE[5:30])]
        losses = []
        for _ in range(4):
            losses.append(trainer.forward_backward(batch, "cross_entropy").loss)
            metrics = trainer.optim_step(AdamStep(learning_rate=1e-2, grad_clip_norm=1.0))
        assert losses[-1] < 0.8 * losses[0], losses
        assert metrics["step"] == 4 and metrics["grad_norm"] > 0
        before = trainer.forward_backward(batch, "cross_entropy", forward_only=True)
        assert all(p.grad is None for p in model.parameters("sft"))  # forward only: no gradient
        assert before.logprobs[0].shape == (len(SEQUENCE) - 1,) and before.tokens == len(SEQUENCE) - 1 + 24
        assert np.isclose(-sum(lp.sum() for lp in before.logprobs), before.loss, rtol=1e-5)
    finally:
        trainer.close()
    assert "sft" not in model.shapes


def test_adapters_on_one_base_model_train_independently(model):
    base = _logprobs(model, None)
    first = AdapterTrainer(model, "first", AdapterShape(rank=4, train_mlp=False), seed=1)
    second = AdapterTrainer(model, "second", AdapterShape(rank=8, train_attn=False), seed=2)
    try:
        untouched = _logprobs(model, "second")
        for _ in range(2):
            first.forward_backward([_datum()], "cross_entropy")
            first.optim_step(AdamStep(learning_rate=1e-2))
        assert not torch.equal(_logprobs(model, "first"), base)
        assert torch.equal(_logprobs(model, "second"), untouched)
        assert torch.equal(_logprobs(model, None), base)
    finally:
        first.close()
        second.close()
    assert model.shapes == {} and model.model is not None
    assert torch.equal(_logprobs(model, None), base)  # the last adapter gone: the bare base model again


def test_a_copy_is_the_adapter_as_it_was_and_stays_so_while_the_source_trains(model):
    """``copy``: a sampler's snapshot of a training adapter (its shape, scaling and tensors), not a view of it."""
    trainer = AdapterTrainer(model, "source", AdapterShape(rank=4, alpha=8, train_mlp=False), seed=3)
    try:
        for _ in range(2):
            trainer.forward_backward([_datum()], "cross_entropy")
            trainer.optim_step(AdamStep(learning_rate=1e-2))
        model.copy("source", "snapshot")
        assert model.shapes["snapshot"] == model.shapes["source"]
        assert torch.equal(_logprobs(model, "snapshot"), _logprobs(model, "source"))
        frozen = _logprobs(model, "snapshot")
        trainer.forward_backward([_datum()], "cross_entropy")
        trainer.optim_step(AdamStep(learning_rate=1e-2))
        assert not torch.equal(_logprobs(model, "source"), frozen)
        assert torch.equal(_logprobs(model, "snapshot"), frozen)
    finally:
        model.remove("snapshot")
        trainer.close()


def test_saved_state_resumes_bit_exact_and_optimizer_state_matters(model):
    batch = [_datum(), _datum(SEQUENCE[3:20])]
    step = AdamStep(learning_rate=5e-3, weight_decay=0.01, grad_clip_norm=5.0)

    def train(trainer, steps):
        for _ in range(steps):
            trainer.forward_backward(batch, "cross_entropy")
            trainer.optim_step(step)

    original = AdapterTrainer(model, "original", AdapterShape(rank=8), seed=3)
    train(original, 2)
    saved = original.state_dict()
    train(original, 2)
    resumed = AdapterTrainer(model, "resumed", AdapterShape(rank=8), seed=99)
    fresh_optimizer = AdapterTrainer(model, "weights-only", AdapterShape(rank=8), seed=99)
    try:
        resumed.load_state_dict(saved)
        fresh_optimizer.load_state_dict(saved, optimizer=False)
        train(resumed, 2)
        train(fresh_optimizer, 2)
        want, got = model.state("original"), model.state("resumed")
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
        assert resumed.steps == 4 and fresh_optimizer.steps == 2
        assert not all(torch.equal(want[k], model.state("weights-only")[k]) for k in want)
    finally:
        for trainer in (original, resumed, fresh_optimizer):
            trainer.close()


def test_sampler_logprobs_equal_the_trainers_and_seeds_reproduce(model):
    trainer = AdapterTrainer(model, "policy", AdapterShape(rank=8), seed=4)
    try:
        trainer.forward_backward([_datum()], "cross_entropy")
        trainer.optim_step(AdamStep(learning_rate=1e-2))
        sampler = HFSampler(model)
        spec = SamplingSpec(max_tokens=8, temperature=1.0, seed=7, stop_at_eos=False)
        prompt = SEQUENCE[:6]
        jobs = [
            SampleJob(prompt, 3, spec, "policy", prompt_logprobs=True, topk_sample=2),
            SampleJob(SEQUENCE[10:13], 2, SamplingSpec(max_tokens=5, temperature=0.0), None),
        ]
        mixed = sampler.sample(jobs)
        alone = sampler.sample(jobs[:1])
        assert [c.tokens for c in mixed[0].completions] == [c.tokens for c in alone[0].completions]
        assert len({tuple(c.tokens) for c in mixed[0].completions}) > 1  # rows draw independently
        for completion in mixed[0].completions:
            full = prompt + completion.tokens
            want = _logprobs(model, "policy", full)[-len(completion.tokens) :]
            assert np.allclose(completion.logprobs, want.numpy(), atol=1e-4)
            assert completion.stop_reason == "length" and len(completion.tokens) == 8
            assert all(
                values[0] >= values[1] and values[0] >= lp
                for (_, values), lp in zip(completion.topk, completion.logprobs)
            )
        greedy = mixed[1].completions
        assert greedy[0].tokens == greedy[1].tokens  # temperature 0: greedy
        with torch.no_grad():
            first = model.model(input_ids=torch.tensor([SEQUENCE[10:13]]), adapter_names=["__base__"]).logits[0, -1]
        assert greedy[0].tokens[0] == int(torch.argmax(first))
        prompt_lp = mixed[0].prompt_logprobs
        assert np.isnan(prompt_lp[0]) and np.allclose(
            prompt_lp[1:], _logprobs(model, "policy", prompt).numpy(), atol=1e-4
        )
    finally:
        trainer.close()


def test_requests_joining_a_running_batch_share_its_steps_and_sample_as_they_would_alone(model):
    """Continuous batching: jobs that arrive between decode steps (other adapters, shorter prompts) enter the running
    batch; each job is done as its rows stop, before the batch ends. The running rows draw exactly the tokens they
    draw alone (nothing in their computation changes); a joined row is left-padded, like a shorter prompt in any
    batch: its logprobs are the trainer's for its tokens and greedy decoding gives the tokens it gives alone."""
    trainer = AdapterTrainer(model, "joiner", AdapterShape(rank=4), seed=8)
    try:
        trainer.forward_backward([_datum()], "cross_entropy")
        trainer.optim_step(AdamStep(learning_rate=1e-2))
        sampler = HFSampler(model)
        first = SampleJob(SEQUENCE[:12], 2, SamplingSpec(max_tokens=10, temperature=1.0, seed=1, stop_at_eos=False))
        sampled = SampleJob(SEQUENCE[5:9], 3, SamplingSpec(max_tokens=4, seed=2, stop_at_eos=False), "joiner")
        greedy = SampleJob(SEQUENCE[20:22], 1, SamplingSpec(max_tokens=12, temperature=0.0, stop_at_eos=False))
        arrivals = {2: [sampled], 3: [greedy]}  # after the 2nd and 3rd decode steps
        steps, events = [], []

        def join(live_rows: int) -> list[SampleJob]:
            steps.append(live_rows)
            return arrivals.get(len(steps), [])

        results = sampler.sample([first], join=join, done=lambda index, result: events.append((len(steps), index)))
        assert steps[:3] == [2, 2, 5]  # the rows in flight when each join was asked
        assert [index for _, index in events] == [1, 0, 2] and events[1][0] < len(steps)  # done as they stop
        alone = sampler.sample([first])[0].completions
        assert [c.tokens for c in results[0].completions] == [c.tokens for c in alone]
        for mine, theirs in zip(results[0].completions, alone):
            assert np.allclose(mine.logprobs, theirs.logprobs, atol=1e-5)
        for completion in results[1].completions:
            full = list(sampled.prompt) + completion.tokens
            want = _logprobs(model, "joiner", full)[-len(completion.tokens) :]
            assert len(completion.tokens) == 4 and np.allclose(completion.logprobs, want.numpy(), atol=1e-4)
        assert results[2].completions[0].tokens == sampler.sample([greedy])[0].completions[0].tokens
    finally:
        trainer.close()


def test_sampler_stops_on_tokens_and_strings_and_refuses_bad_stops(model):
    sampler = HFSampler(model)
    prompt = SEQUENCE[:5]
    free = sampler.sample([SampleJob(prompt, 1, SamplingSpec(max_tokens=12, temperature=0.0, stop_at_eos=False))])
    tokens = free[0].completions[0].tokens
    spec = SamplingSpec(max_tokens=12, temperature=0.0, stop_at_eos=False, stop_tokens=(tokens[3],))
    by_token = sampler.sample([SampleJob(prompt, 1, spec)])
    stopped = by_token[0].completions[0]
    assert stopped.tokens == tokens[: tokens.index(tokens[3]) + 1] and stopped.stop_reason == "stop"
    text = model.tokenizer.decode(tokens[:5], skip_special_tokens=False)
    needle = text[-2:]
    by_string = sampler.sample(
        [SampleJob(prompt, 1, SamplingSpec(max_tokens=12, temperature=0.0, stop_at_eos=False, stop_strings=(needle,)))]
    )[0].completions[0]
    assert by_string.stop_reason == "stop" and needle in model.tokenizer.decode(by_string.tokens)
    assert len(by_string.tokens) <= 5
    bad = [
        (SamplingSpec(max_tokens=4, stop_strings=("",)), "stop strings must be 1-256 characters"),
        (SamplingSpec(max_tokens=4, stop_tokens=(10**9,)), "token id 1000000000 is not in"),
        (SamplingSpec(max_tokens=10**6), "exceed the model's context"),
        (SamplingSpec(max_tokens=4, top_p=0.0), "top_p must be in (0, 1]"),
    ]
    for spec, message in bad:
        with pytest.raises(SamplingError) as caught:
            sampler.sample([SampleJob(prompt, 1, spec)])
        assert message in str(caught.value)


def test_a_saved_adapter_is_a_peft_folder_the_registry_can_serve(model, tmp_path):
    from opentinker.agents.lm_policy import load_adapted_model

    trainer = AdapterTrainer(model, "export", AdapterShape(rank=4), seed=5)
    try:
        trainer.forward_backward([_datum()], "cross_entropy")
        trainer.optim_step(AdamStep(learning_rate=1e-2))
        folder = model.save("export", tmp_path / "adapter", step=1)
        want = _logprobs(model, "export")
        model.load("reloaded", folder)
        assert torch.allclose(_logprobs(model, "reloaded"), want, atol=1e-5)
        merged, _, meta = load_adapted_model(folder, CACHE)
        assert meta["base_model"] == "tiny" and meta["step"] == 1
        with torch.no_grad():
            logits = merged(input_ids=torch.tensor([SEQUENCE[:-1]])).logits[0].float()
        served = torch.log_softmax(logits, -1).gather(-1, torch.tensor(SEQUENCE[1:]).unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(served, want, atol=1e-4)
    finally:
        trainer.close()
        model.remove("reloaded")


def test_positions_without_a_loss_skip_their_backward_not_their_logprobs(model):
    """The output projection runs with the graph only where the loss can have a gradient: same logprobs everywhere,
    same gradient."""
    trainer = AdapterTrainer(model, "masked", AdapterShape(rank=4), seed=6)
    try:
        targets = [torch.tensor(SEQUENCE[1:])]
        advantages = torch.zeros(len(SEQUENCE) - 1)
        advantages[-8:] = torch.linspace(-1, 1, 8)
        grads = []
        for active in (None, [advantages != 0]):
            logp = model.target_logprobs("masked", [SEQUENCE[:-1]], targets, active)[0]
            (-(logp * advantages).sum()).backward()
            grads.append([p.grad.clone() for p in model.parameters("masked")])
            for p in model.parameters("masked"):
                p.grad = None
            if active is None:
                full = logp.detach()
        assert torch.allclose(logp.detach(), full, atol=1e-5)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))
        flat = {
            "logprobs": np.zeros(len(SEQUENCE) - 1, np.float32),
            "advantages": np.zeros(len(SEQUENCE) - 1, np.float32),
        }
        result = trainer.forward_backward([_datum(**flat)], "importance_sampling")  # a group of equal rewards
        assert result.loss == 0.0 and all(p.grad is None for p in model.parameters("masked"))
    finally:
        trainer.close()


def test_top_k_and_top_p_cut_the_distribution(model):
    """top_k=1 and a tiny top_p leave only the most likely token: sampling at any temperature is then greedy."""
    sampler = HFSampler(model)
    prompt = SEQUENCE[:6]
    greedy = sampler.sample([SampleJob(prompt, 1, SamplingSpec(max_tokens=6, temperature=0.0, stop_at_eos=False))])
    want = greedy[0].completions[0].tokens
    for spec in (
        SamplingSpec(max_tokens=6, temperature=2.0, top_k=1, seed=1, stop_at_eos=False),
        SamplingSpec(max_tokens=6, temperature=2.0, top_p=1e-6, seed=2, stop_at_eos=False),
    ):
        rows = sampler.sample([SampleJob(prompt, 3, spec)])[0].completions
        assert all(row.tokens == want for row in rows), spec
    wide = sampler.sample(
        [SampleJob(prompt, 8, SamplingSpec(max_tokens=6, temperature=2.0, seed=3, stop_at_eos=False))]
    )
    assert any(row.tokens != want for row in wide[0].completions)  # without the cut, rows differ


def test_cross_entropy_takes_k_targets_per_position(model):
    """(N, K) target tokens with (N, K) weights (distillation onto a top-K distribution): logprobs of that shape."""
    trainer = AdapterTrainer(model, "distill", AdapterShape(rank=4), seed=7)
    try:
        n = len(SEQUENCE) - 1
        targets = np.stack([np.array(SEQUENCE[1:]), np.array(SEQUENCE[1:]) + 1], axis=1)
        weights = np.tile(np.array([[0.75, 0.25]], np.float32), (n, 1))
        weights[:5] = 0.0  # a prompt: no loss there
        datum = TokenDatum(SEQUENCE[:-1], {"target_tokens": targets, "weights": weights})
        result = trainer.forward_backward([datum], "cross_entropy")
        assert result.logprobs[0].shape == (n, 2)
        assert np.isclose(result.loss, -(weights * result.logprobs[0]).sum(), rtol=1e-5)
        first = _logprobs(model, "distill").numpy()
        assert np.allclose(result.logprobs[0][:, 0], first, atol=1e-5)  # column 0 is the sequence itself
        assert all(p.grad is not None for p in model.parameters("distill"))
    finally:
        trainer.close()


def test_a_batch_of_several_clients_gives_each_the_gradients_it_would_get_alone(model):
    """Three clients (different ranks, targets and losses) in one ``forward_backward_many``: rows of every adapter
    share the decoder pass, and each adapter's gradient, loss and logprobs equal those of its own pass alone."""
    from opentinker.agents.adapter_trainer import Part, forward_backward_many

    n = len(SEQUENCE) - 1
    rng = np.random.default_rng(0)
    rl = {"logprobs": rng.normal(-2, 0.3, n).astype(np.float32), "advantages": rng.normal(0, 1, n).astype(np.float32)}
    clients = [
        (AdapterShape(4), [_datum(), _datum(SEQUENCE[:20])], "cross_entropy"),
        (AdapterShape(8, train_unembed=False), [_datum(**rl)], "importance_sampling"),
        (AdapterShape(4, train_mlp=False), [_datum(SEQUENCE[5:], **{k: v[5:] for k, v in rl.items()})], "ppo"),
    ]
    generator = torch.Generator().manual_seed(0)
    alone, mixed = [], []
    for i, (shape, _, _) in enumerate(clients):
        alone.append(AdapterTrainer(model, f"alone{i}", shape, seed=i))
        mixed.append(AdapterTrainer(model, f"mixed{i}", shape, seed=i))
        state = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in model.state(f"alone{i}").items()}
        model.load_state(f"alone{i}", state)  # B non-zero: A gets a gradient too
        model.load_state(f"mixed{i}", state)
    try:
        expected = [t.forward_backward(data, loss) for t, (_, data, loss) in zip(alone, clients)]
        parts = [Part(t, data, loss, t.check(data, loss, None)) for t, (_, data, loss) in zip(mixed, clients)]
        results = forward_backward_many(parts)
        for want, got, a, m in zip(expected, results, alone, mixed):
            assert got.loss == pytest.approx(want.loss, rel=1e-5, abs=1e-5) and got.tokens == want.tokens
            assert all(np.allclose(x, y, atol=1e-5) for x, y in zip(want.logprobs, got.logprobs))
            grads = [(p.grad, q.grad) for p, q in zip(model.parameters(a.name), model.parameters(m.name))]
            assert all(g is not None for pair in grads for g in pair)
            assert all(torch.allclose(p, q, rtol=1e-4, atol=1e-6) for p, q in grads)
    finally:
        for trainer in alone + mixed:
            trainer.close()


def test_grouped_mixed_batches_equal_pefts_own(model):
    """``agents/lora_rows.py``: a mixed batch whose adapters' rows are consecutive runs each adapter on its own rows;
    its log-probabilities and each adapter's gradient equal those of peft's gather and scatter, which an interleaved
    order of the same rows still takes."""
    from peft.tuners.lora import layer

    trainers = [AdapterTrainer(model, f"rows{i}", AdapterShape(rank=4), seed=20 + i) for i in range(2)]
    try:
        generator = torch.Generator().manual_seed(1)
        for t in trainers:  # B non-zero: the adapters change the logits
            state = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in model.state(t.name).items()}
            model.load_state(t.name, state)
        rows = [SEQUENCE[i : i + 12] for i in range(4)]
        grouped = ["rows0", "rows0", "rows1", "rows1"]
        interleaved = [0, 2, 1, 3]  # rows0, rows1, rows0, rows1: not consecutive

        def run(order: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            logps = model.target_logprobs(
                [grouped[i] for i in order], [rows[i][:-1] for i in order], [torch.tensor(rows[i][1:]) for i in order]
            )
            torch.stack([lp.sum() for lp in logps]).sum().backward()
            grads = [p.grad.clone() for t in trainers for p in model.parameters(t.name)]
            for t in trainers:
                for p in model.parameters(t.name):
                    p.grad = None
            return [logps[order.index(i)].detach() for i in range(len(rows))], grads

        assert getattr(layer.Linear._mixed_batch_forward, "grouped", False)
        fast, slow = run([0, 1, 2, 3]), run(interleaved)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(fast[0], slow[0]))
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(fast[1], slow[1]))
    finally:
        for t in trainers:
            t.close()
