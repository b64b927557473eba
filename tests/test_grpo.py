"""GRPO for the agent's language model, on the tiny Llama built in code: the maths, learning, resume, Ray rollouts,
text envs and their failure modes (bad names, malformed tool calls, tool time-outs)."""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from opentinker.agents.grpo import (
    GRPOConfig,
    group_advantages,
    grpo_config,
    reduce_loss,
    token_loss,
)
from opentinker.agents.grpo_trainer import GRPO
from opentinker.envs.errors import EnvSpecError
from opentinker.envs.text import TextEnv, TextExample
from opentinker.envs.text_tasks import (
    TEXT_TASKS,
    TextTaskSpec,
    make_text_env,
    task_examples,
)

CACHE = str(Path(tempfile.gettempdir()) / "opentinker-test-llm-cache")  # shared with the local_chat_model fixture
TINY = {
    "base_model": "tiny",
    "cache_dir": CACHE,
    "group_size": 4,
    "prompts_per_step": 2,
    "max_new_tokens": 6,
    "eval_prompts": 4,
    "eval_batch": 4,
}


def test_group_advantages_are_normalised_within_each_group_and_zero_for_equal_rewards():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    adv = group_advantages(rewards)
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]) / (rewards[0].std() + 1e-4) * 0.5)
    assert torch.equal(adv[1], torch.zeros(4))
    assert torch.allclose(group_advantages(rewards, scale=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_equal_rewards_give_no_gradient_and_clipping_stops_it_outside_the_range():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0]])
    loss, _ = token_loss(logp, old, None, torch.zeros(1, 1), 0.2, 0.0)
    reduce_loss(loss, torch.ones(1, 2), "token", 2.0, 1).backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2))

    # ratio e^0.5 > 1.2 with A > 0: clipped, no gradient; ratio 1 inside the range: gradient -A/n.
    logp = torch.tensor([[-0.5, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0]])
    loss, _ = token_loss(logp, old, None, torch.ones(1, 1), 0.2, 0.0)
    reduce_loss(loss, torch.ones(1, 2), "token", 2.0, 1).backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] == pytest.approx(-0.5)
    # the same ratio with A < 0 is not clipped (the pessimistic branch keeps the gradient)
    logp.grad = None
    loss, _ = token_loss(logp, old, None, -torch.ones(1, 1), 0.2, 0.0)
    reduce_loss(loss, torch.ones(1, 2), "sequence", 2.0, 1).backward()
    assert logp.grad[0, 0] != 0


def test_the_config_maps_onto_the_engines_adapter_shape():
    peft = GRPOConfig(lora_rank=8, lora_alpha=16).lora.peft_config()
    assert (peft.r, peft.lora_alpha) == (8, 16)
    assert "lm_head" not in peft.target_modules and {"q_proj", "down_proj"} <= set(peft.target_modules)
    with pytest.raises(ValueError, match=r"GRPOConfig\.lora_rank"):
        GRPOConfig(lora_rank=600)


@pytest.fixture(scope="module")
def tiny_trainer():
    trainer = GRPO(GRPOConfig(**TINY, learning_rate=1e-2), seed=3, workers=1, backend="local")
    yield trainer
    trainer.close()


def test_kl_is_zero_with_the_adapter_off_and_positive_once_it_differs(tiny_trainer):
    from opentinker.agents.grpo import completion_logprobs

    model = tiny_trainer.model
    prompts, completions = [[1, 2, 3, 4], [5, 6]], [[7, 8, 9], [10, 11]]
    chunk = list(zip(prompts, completions, [0.0, 0.0]))
    with torch.no_grad():
        for name, param in model.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
        ref = tiny_trainer._logprobs(chunk, None)[0]
        off, mask = completion_logprobs(model, None, prompts, completions)
        on, _ = tiny_trainer._logprobs(chunk)
        # the same numbers as the Tinker engine's forward over whole sequences
        whole = model.target_logprobs("policy", [[1, 2, 3, 4, 7, 8]], [torch.tensor([2, 3, 4, 7, 8, 9])])
        for name, param in model.model.named_parameters():
            if "lora_B" in name:
                param.zero_()
    _, kl_off = token_loss(off, off, ref, torch.ones(2, 1), 0.2, 0.1)
    _, kl_on = token_loss(on, on, ref, torch.ones(2, 1), 0.2, 0.1)
    assert torch.equal((kl_off * mask).sum(), torch.tensor(0.0))
    assert float((kl_on * mask).sum()) > 1e-3
    assert mask.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    assert torch.allclose(on[0], whole[0][3:], atol=1e-5)


def _upper_share(answer: str, example: TextExample) -> float:
    """The verifier of the learning test: the share of the reply's letters that are capitals."""
    letters = [c for c in answer if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(len(letters), 1)


def _shout(rng: np.random.Generator, n: int) -> list[TextExample]:
    return [TextExample(f"Shout {i}.", "") for i in range(n)]


@pytest.fixture
def shout_task(monkeypatch):
    """A text task whose verifier the random tiny model can satisfy a little, and learn to satisfy more."""
    monkeypatch.setitem(
        TEXT_TASKS,
        "shout",
        TextTaskSpec("shout", "reply in capitals", _shout, (), max_turns=1, size=(16, 4), reward_fn=_upper_share),
    )


def test_tiny_model_learns_a_target_behaviour_from_a_verifier_reward(shout_task):
    config = GRPOConfig(
        **{
            **TINY,
            "task": "shout",
            "group_size": 8,
            "prompts_per_step": 2,
            "max_new_tokens": 4,
            "temperature": 1.0,
            "learning_rate": 5e-2,
            "kl_coef": 0.0,
        }
    )
    trainer = GRPO(config, seed=0, workers=1, backend="local")
    try:
        before = trainer.evaluate(split="train", prompts=8).mean_reward
        history = []
        trainer.train(20, callback=lambda m, step: history.append(m["train/reward_mean"]))
        after = trainer.evaluate(split="train", prompts=8).mean_reward
    finally:
        trainer.close()
    assert np.mean(history[-5:]) > np.mean(history[:5]) + 0.15, history
    assert after > before + 0.15, (before, after)


def test_resume_is_bit_exact(tmp_path, shout_task):
    config = GRPOConfig(**{**TINY, "task": "shout"}, learning_rate=1e-2, temperature=1.0)
    straight = GRPO(config, seed=5, workers=1, backend="local")
    straight.train(2, checkpoint_dir=tmp_path)
    straight.train(4)
    resumed = GRPO.load(tmp_path / "checkpoint.pt", workers=1, backend="local")
    assert resumed.updates == 2 and resumed.sampler.state() != {"epoch": 0, "position": 0}
    resumed.train(4)
    a, b = straight.model.state("policy"), resumed.model.state("policy")
    assert any(float(v.abs().sum()) > 0 for k, v in a.items() if "lora_B" in k)  # it did learn something
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sa)
    assert straight.sampler.state() == resumed.sampler.state()


@pytest.mark.slow  # model-holding Ray actors
def test_rollouts_are_the_same_on_one_and_two_ray_workers(ray_session):
    config = GRPOConfig(**TINY, temperature=1.0)
    runs = []
    for workers in (1, 2):
        trainer = GRPO(config, seed=7, workers=workers, backend="ray")
        try:
            episodes, sent = trainer.rollout(3, [5, 9, 11])
            again = episodes
            if workers == 2:  # a killed worker is restarted by Ray and its retried rollout is the same
                os.kill(trainer.pool.call("pid")[0], signal.SIGKILL)
                again = trainer.rollout(3, [5, 9, 11])[0]
        finally:
            trainer.close()
        assert [t.completion_ids for e in episodes for t in e.turns] == [
            t.completion_ids for e in again for t in e.turns
        ]
        runs.append([(e.group, e.index, [t.completion_ids for t in e.turns]) for e in episodes])
        assert 0 < sent < 10_000_000  # only the adapter crosses, not the model
    assert runs[0] == runs[1]
    assert len({tuple(c[2][0]) for c in runs[0]}) > 1  # sampled, not all alike


def test_text_envs_pass_validate_env_and_splits_do_not_overlap():
    from opentinker.envs.validation import validate_env

    for name in TEXT_TASKS:
        validate_env(make_text_env(name, "heldout"))
        train = {e.prompt for e in task_examples(name, "train")}
        assert not train & {e.prompt for e in task_examples(name, "heldout")}
    assert task_examples("arithmetic", "heldout", seed=1) != task_examples("arithmetic", "heldout", seed=0)


def test_tool_calls_run_and_failures_become_observations_or_negative_rewards():
    from opentinker.llm import PythonREPL, SandboxLimits

    env = TextEnv(
        [TextExample("What is 6 * 7?", "42")], tools=[PythonREPL(limits=SandboxLimits(wall_time_s=1.0))], max_turns=3
    )
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(
        '<tool_call>{"name": "python_repl", "arguments": {"code": "print(6*7)"}}</tool_call>'
    )
    assert obs == '<tool_result name="python_repl">42</tool_result>' and reward == 0 and not terminated
    loop = '<tool_call>{"name": "python_repl", "arguments": {"code": "while True: pass"}}</tool_call>'
    obs, reward, *_ = env.step(loop)
    assert "killed" in obs and reward == 0  # a tool that times out is an observation, never a crash
    obs, reward, terminated, truncated, info = env.step('<tool_call>{"name": "python_repl", "argum')
    assert "invalid tool call" in obs and reward == pytest.approx(-0.1) and truncated
    assert info["invalid_tool_calls"] == 1
    env.reset(seed=0)
    env.step('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>')  # unknown tool: invalid, not run
    _, reward, terminated, _, info = env.step("It is 42.")
    assert reward == 1.0 and terminated and info["success"]


def test_a_task_tool_that_is_not_installed_is_a_clear_error(monkeypatch):
    import dataclasses

    monkeypatch.setitem(TEXT_TASKS, "calc", dataclasses.replace(TEXT_TASKS["arithmetic"], tools=("calculator",)))
    with pytest.raises(EnvSpecError, match=r"tools: no tool 'calculator' is installed.*python_repl"):
        make_text_env("calc")
    assert make_text_env("calc", tools=[]).tools == {}  # tools= from the caller: nothing looked up


def test_bad_names_and_fields_are_clear_errors():
    with pytest.raises(EnvSpecError, match=r"unknown text task 'nope'.*arithmetic"):
        make_text_env("nope")
    with pytest.raises(ValueError, match="unknown GRPOConfig field 'group'"):
        grpo_config({"group": 4})
    with pytest.raises(ValueError, match=r"GRPOConfig\.group_size"):
        GRPOConfig(group_size=1)
    with pytest.raises(EnvSpecError, match="split"):
        task_examples("arithmetic", "test")


def test_cli_reports_bad_task_algo_and_config_field(tmp_path):
    from typer.testing import CliRunner

    from opentinker.cli import app

    runner = CliRunner()
    bad_task = runner.invoke(app, ["train", "nope", "--algo", "grpo"])
    assert bad_task.exit_code == 1 and "unknown text task 'nope'" in bad_task.output
    bad_algo = runner.invoke(app, ["train", "CartPole-v1", "--algo", "a2c"])
    assert bad_algo.exit_code == 1 and "algorithm" in bad_algo.output
    config = tmp_path / "grpo.toml"
    config.write_text("[grpo]\ngroup_sise = 4\n")
    bad_field = runner.invoke(app, ["train", "arithmetic", "--algo", "grpo", "--config", str(config)])
    assert bad_field.exit_code == 1 and "group_sise" in bad_field.output
