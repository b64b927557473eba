"""The bundled SmolLM2-135M through the real agent loop: tool call → sandboxed tool result → final answer."""

from __future__ import annotations

from langchain_core.messages import HumanMessage

from opentinker.llm import LangChainAgent, PythonREPL, WebSearch


def test_local_model_calls_a_tool_and_answers_from_its_result(local_chat_model):
    agent = LangChainAgent(local_chat_model, [PythonREPL()], checkpointer="memory", max_steps=3)
    reply = agent.chat("Use python_repl to compute 17*23.")
    assert [c.name for c in reply.tool_calls] == ["python_repl"]
    call = reply.tool_calls[0]
    assert "17" in call.args["code"] and "23" in call.args["code"]
    assert call.status == "success" and call.content == "391"  # really executed in the sandbox
    assert "391" in reply.text  # the answer was written after reading the tool result
    assert reply.input_tokens > 0 and reply.output_tokens > 0


def test_tool_choice_forces_a_well_formed_call_to_the_named_tool(local_chat_model):
    model = local_chat_model.bind_tools([PythonREPL(), WebSearch()], tool_choice="web_search")
    message = model.invoke([HumanMessage("Tell me about the training flows.")])
    assert [c["name"] for c in message.tool_calls] == ["web_search"]
    assert isinstance(message.tool_calls[0]["args"].get("query"), str) and message.tool_calls[0]["args"]["query"]
    assert message.tool_calls[0]["id"].startswith("call_")
