"""AgentService over real HTTP (``bentoml serve`` on loopback): auth, validation, tools, restart, tracing."""

from __future__ import annotations

import httpx
import pytest

from opentinker.serving.agent_service import serve_agent

API_KEY = "agent-test-key-0123456789"


@pytest.mark.slow
def test_agent_service_auth_validation_and_conversation_survives_restart(tmp_path):
    config = {
        "llm": "scripted",
        "tools": ["python_repl", "web_search"],
        "memory_window": 3,
        "checkpoint_db": str(tmp_path / "threads.sqlite"),
        "tracing": False,
    }
    service = serve_agent(API_KEY, config, log_path=tmp_path / "agent-1.log")
    try:
        body = {"thread_id": "t-1", "message": "the code word is kiwi"}
        assert httpx.post(f"{service.url}/chat", json=body, timeout=30).status_code == 401
        wrong = httpx.post(
            f"{service.url}/chat", json=body, timeout=30, headers={"Authorization": "Bearer nope-nope-nope"}
        )
        assert wrong.status_code == 401
        bad = httpx.post(
            f"{service.url}/chat",
            json={"thread_id": "has space", "message": "  "},
            timeout=30,
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
        assert bad.status_code == 400
        assert {tuple(e["loc"]) for e in bad.json()["detail"]} == {("thread_id",), ("message",)}

        first = service.chat("t-1", "the code word is kiwi")
        assert first["reply"].startswith("You said: the code word is kiwi")
        tools = service.chat("t-1", '/python_repl {"code": "6 * 7"} /web_search {"query": "module contracts"}')
        assert [c["name"] for c in tools["tool_calls"]] == ["python_repl", "web_search"]
        assert tools["tool_calls"][0]["content"] == "42" and "architecture.md" in tools["tool_calls"][1]["content"]
        assert all(c["latency_s"] is not None for c in tools["tool_calls"]) and tools["input_tokens"] > 0
    finally:
        service.stop()
    assert service.process.poll() is not None

    restarted = serve_agent(API_KEY, config, log_path=tmp_path / "agent-2.log")
    try:
        reply = restarted.chat("t-1", "what was the code word?")
        assert "Earlier: the code word is kiwi" in reply["reply"]  # state came back from SQLite
        other = restarted.chat("t-2", "hello")
        assert "Earlier: (nothing)" in other["reply"]  # threads stay apart
        history = restarted.history("t-1")
        assert next(m["content"] for m in history["messages"] if m["type"] == "human") == "the code word is kiwi"
    finally:
        restarted.stop()


def test_agent_runs_are_traced_to_mlflow_with_tool_spans_and_token_usage(tmp_path):
    import mlflow
    from fixtures.llm import make_slow_tool

    from opentinker.llm import LangChainAgent
    from opentinker.serving.agent_service import enable_tracing

    enable_tracing(experiment="llm-tracing-test")
    try:
        agent = LangChainAgent("scripted", [make_slow_tool(0.2, [])], checkpointer="memory")
        agent.chat('/slow_echo {"text": "a"} /slow_echo {"text": "b"}')
        mlflow.flush_trace_async_logging()
        traces = mlflow.search_traces(return_type="list", max_results=5)
    finally:
        mlflow.langchain.autolog(disable=True)
    assert traces, "no trace was logged"
    trace = traces[0]
    tool_spans = [s for s in trace.data.spans if s.span_type == "TOOL"]
    assert len(tool_spans) == 2
    assert all((s.end_time_ns - s.start_time_ns) / 1e9 >= 0.19 for s in tool_spans)  # tool latencies
    usage = trace.info.token_usage
    assert usage and usage["input_tokens"] > 0 and usage["output_tokens"] > 0
