"""GRPO through the pipeline on the tiny model: probe → train on 2 Ray workers → held-out evaluation → registered
adapter (base model recorded) → champion gate; then the agent service serves ``models:/NAME@champion`` over HTTP
(API-key auth) and answers the held-out prompts exactly as the evaluation did."""

from __future__ import annotations

import tempfile
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow  # starts real services or trains through a flow

API_KEY = "grpo-agent-key-0123456789"
CACHE = str(Path(tempfile.gettempdir()) / "opentinker-test-llm-cache")


def test_grpo_flow_registers_an_adapter_that_the_agent_service_serves(ray_session, tmp_path):
    import mlflow

    from opentinker.flows.train import train_flow
    from opentinker.serving.agent_service import serve_agent
    from opentinker.tasks.spec import RunSpec
    from opentinker.tracking.registry import _client

    grpo = {
        "base_model": "tiny",
        "cache_dir": CACHE,
        "group_size": 2,
        "prompts_per_step": 2,
        "max_new_tokens": 6,
        "eval_prompts": 4,
        "eval_batch": 4,
        "learning_rate": 1e-2,
    }
    spec = RunSpec(
        env_id="arithmetic",
        algorithm="grpo",
        updates=2,
        workers=2,
        grpo=grpo,
        run_name="grpo-tiny",
        model_name="test-grpo-agent",
        eval_every=1,
    )
    result = train_flow(spec)
    assert result.updates == 2 and result.model_version == "1"
    assert result.aliases == ["candidate", "champion"] and "first champion" in result.decision
    version = _client().get_model_version("test-grpo-agent", "1")
    assert version.tags["base_model"] == "tiny" and version.tags["task"] == "arithmetic"
    run = mlflow.get_run(result.run_id)
    for key in (
        "train/reward_mean",
        "train/kl",
        "train/completions_per_s",
        "train/tokens_per_s",
        "train/valid_tool_call_rate",
        "train/response_tokens",
        "eval/success_rate",
        "heldout/success_rate",
    ):
        assert key in run.data.metrics, key
    steps = [m.step for m in _client().get_metric_history(result.run_id, "eval/success_rate")]
    assert steps == [0, 1]  # the base model at step 0, then every eval_every steps
    tables = {a.path for a in _client().list_artifacts(result.run_id, "episodes")}
    assert {"episodes/eval_step_000000.json", "episodes/heldout_step_000002.json"} <= tables

    # The same adapter registered again is no better on the same prompts: the champion stays where it is.
    from opentinker.tasks.llm import gate_adapter, register_adapter

    again = register_adapter.fn(result.run_id, result.adapter_dir, "test-grpo-agent", "tiny", "arithmetic")
    gate = gate_adapter.fn("test-grpo-agent", again, result.evaluation, 0.0, 4, CACHE)
    assert again == "2" and gate.aliases == ["candidate"] and "kept champion v1" in gate.decision
    assert gate.champion_success == result.evaluation.success

    # Served: base + adapter, no constrained decoding; the held-out answers are the evaluation's.
    from opentinker.envs.text import exact_integer
    from opentinker.envs.text_tasks import task_examples

    table = mlflow.load_table("episodes/heldout_step_000002.json", run_ids=[result.run_id])
    service = serve_agent(
        API_KEY,
        {
            "llm": "models:/test-grpo-agent@champion",
            "tools": ["python_repl"],
            "tracing": False,
            "checkpoint_db": str(tmp_path / "threads.sqlite"),
        },
        log_path=tmp_path / "agent.log",
    )
    try:
        unauthorised = httpx.post(f"{service.url}/chat", json={"thread_id": "t", "message": "hi"}, timeout=30)
        assert unauthorised.status_code == 401
        examples = task_examples("arithmetic", "heldout")[:4]
        replies = [service.chat(f"heldout-{i}", e.prompt)["reply"] for i, e in enumerate(examples)]
    finally:
        service.stop()
    served_success = sum(exact_integer(r, e) for r, e in zip(replies, examples)) / len(examples)
    assert abs(served_success - result.evaluation.success) <= 0.25
    single_turn = [a for a, calls in zip(table["answer"], table["tool_calls"]) if calls == "[]"]
    assert sum(r.strip() == a.strip() for r, a in zip(replies, table["answer"])) >= len(single_turn) - 1
