"""LangChainAgent plumbing with the deterministic scripted model (real LangChain tool-calling interface)."""

from __future__ import annotations

import pytest
from fixtures.llm import failing_tool, make_slow_tool
from langchain_core.messages import AIMessage, HumanMessage

from opentinker.llm import (
    LangChainAgent,
    LocalDocsBackend,
    PolicyTool,
    WebSearch,
    resolve_chat_model,
)
from opentinker.llm.memory import messages_outside_window
from opentinker.llm.scripted_model import ScriptedChatModel


def test_scripted_model_emits_real_tool_calls_via_bind_tools():
    slow = make_slow_tool(0.0, [])
    model = ScriptedChatModel().bind_tools([slow])
    reply = model.invoke([HumanMessage('/slow_echo {"text": "a"} /slow_echo {"text": "b"} /unknown {"x": 1}')])
    assert isinstance(reply, AIMessage)
    assert [(c["name"], c["args"]) for c in reply.tool_calls] == [
        ("slow_echo", {"text": "a"}),
        ("slow_echo", {"text": "b"}),
    ]
    assert len({c["id"] for c in reply.tool_calls}) == 2
    assert reply.usage_metadata["total_tokens"] > 0


def test_two_tool_calls_in_one_turn_run_concurrently_and_keep_their_ids(tmp_path):
    log: list = []
    agent = LangChainAgent("scripted", [make_slow_tool(1.5, log)], checkpointer=tmp_path / "t.sqlite")
    try:
        reply = agent.chat('/slow_echo {"text": "first"} /slow_echo {"text": "second"}')
    finally:
        agent.close()
    (_a, a_start, a_end), (_b, b_start, b_end) = sorted(log)
    assert max(a_start, b_start) < min(a_end, b_end), "the two calls did not overlap in time"
    assert [(c.args["text"], c.content) for c in reply.tool_calls] == [
        ("first", "echo:first"),
        ("second", "echo:second"),
    ]
    assert all(c.latency_s >= 1.4 for c in reply.tool_calls)
    ids = [c.id for c in reply.tool_calls]
    assert len(set(ids)) == 2 and all(f"[{i}]" in reply.text for i in ids)  # results went back under their call ids


def test_max_parallel_tools_bounds_concurrency(tmp_path):
    log: list = []
    agent = LangChainAgent("scripted", [make_slow_tool(0.5, log)], checkpointer="memory", max_parallel_tools=1)
    agent.chat('/slow_echo {"text": "a"} /slow_echo {"text": "b"}')
    (_, _a_start, a_end), (_, b_start, _b_end) = sorted(log, key=lambda r: r[1])
    assert b_start >= a_end, "with max_parallel_tools=1 the calls must not overlap"


def test_a_failing_tool_is_reported_to_the_model_not_raised(tmp_path):
    agent = LangChainAgent("scripted", [failing_tool, make_slow_tool(0.0, [])], checkpointer="memory")
    reply = agent.chat('/failing_tool {"x": 3} /slow_echo {"text": "still fine"}')
    broken, ok = reply.tool_calls
    assert broken.status == "error" and "RuntimeError: tool broke on 3" in broken.content
    assert ok.status == "success" and ok.content == "echo:still fine"
    assert "tool broke on 3" in reply.text and "echo:still fine" in reply.text  # the model saw both


def test_bad_tool_arguments_come_back_as_an_error_message():
    agent = LangChainAgent("scripted", [failing_tool], checkpointer="memory")
    reply = agent.chat('/failing_tool {"x": "not a number"}')
    assert reply.tool_calls[0].status == "error"
    assert reply.text.startswith("Tool results:")


def test_memory_window_keeps_last_turns_and_summarises_the_rest():
    agent = LangChainAgent("scripted", [], memory_window=2, checkpointer="memory")
    for word in ["alpha", "bravo", "charlie", "delta"]:
        reply = agent.chat(f"turn {word}")
    # The model saw only the last 2 turns verbatim, and the summary of the two older ones.
    assert "Earlier: turn charlie" in reply.text and "alpha" not in reply.text.split("Summary:")[0]
    assert "Summary:" in reply.text and "user: turn alpha" in reply.summary and "user: turn bravo" in reply.summary
    messages, summary = agent.history()
    assert [m.text for m in messages if isinstance(m, HumanMessage)] == ["turn charlie", "turn delta"]
    assert summary == reply.summary


def test_window_never_splits_a_turn():
    messages = [
        HumanMessage("1"),
        AIMessage("", tool_calls=[{"name": "t", "args": {}, "id": "c1"}]),
        AIMessage("done 1"),
        HumanMessage("2"),
        AIMessage("done 2"),
        HumanMessage("3"),
    ]
    dropped = messages_outside_window(messages, window=2)
    assert [m.text for m in dropped] == ["1", "", "done 1"]
    assert messages_outside_window(messages, window=3) == []


def test_threads_persist_in_sqlite_across_agent_instances(tmp_path):
    db = tmp_path / "threads.sqlite"
    first = LangChainAgent("scripted", [], checkpointer=db)
    first.chat("my name is Ada", thread_id="user-1")
    first.chat("unrelated", thread_id="user-2")
    first.close()
    second = LangChainAgent("scripted", [], checkpointer=f"sqlite:///{db}")
    try:
        reply = second.chat("who am I?", thread_id="user-1")
    finally:
        second.close()
    assert "Earlier: my name is Ada" in reply.text and "unrelated" not in reply.text


def test_web_search_default_backend_indexes_project_docs():
    search = WebSearch()
    assert isinstance(search.backend, LocalDocsBackend)
    out = search.invoke({"query": "module contracts RemoteEnv"})
    assert "architecture.md" in out
    assert search.invoke({"query": "zzzqqq"}).startswith("No results")


def test_web_search_backend_is_pluggable():
    class Fixed:
        def search(self, query, k):
            from opentinker.llm import SearchHit

            return [SearchHit("t", "mem", f"about {query}", 1.0)]

    assert "about ppo" in WebSearch(backend=Fixed()).invoke({"query": "ppo"})
    with pytest.raises(TypeError, match="backend"):
        WebSearch(backend=object())


def test_llm_option_errors_are_clear():
    with pytest.raises(ValueError, match="llm: expected"):
        resolve_chat_model(42)
    for name in ("gpt-4o", "openai:gpt-4o"):  # a bare name: LangChain infers the provider, as with the prefix
        with pytest.raises(ValueError, match=r"langchain-openai.*llm='local'"):
            resolve_chat_model(name)  # the provider package is not installed here
    with pytest.raises(ValueError, match=r"llm='no-such-model'.*Unable to infer model provider"):
        resolve_chat_model("no-such-model")
    with pytest.raises(ValueError, match="memory_window"):
        LangChainAgent("scripted", [], memory_window=0, checkpointer="memory")


@pytest.mark.slow  # a real bentoml serve
def test_policy_tool_queries_the_served_policy(policy_server):
    from fixtures.serving import SERVING_API_KEY

    obs = [0.01, -0.02, 0.03, 0.04]
    via_deployment = PolicyTool(policy_server.predict)
    via_http = PolicyTool(url=policy_server.url, api_key=SERVING_API_KEY)
    expected = policy_server.predict(obs)
    assert via_deployment.invoke({"observation": obs}) == str(expected)
    assert via_http.invoke({"observation": obs}) == str(expected)
    with pytest.raises(Exception, match="401"):
        PolicyTool(url=policy_server.url, api_key="wrong-key-123")._run(obs)
    agent = LangChainAgent("scripted", [via_http], checkpointer="memory")
    reply = agent.chat('/policy {"observation": [0.01, -0.02, 0.03, 0.04]}')
    assert reply.tool_calls[0].status == "success" and reply.tool_calls[0].content == str(expected)
