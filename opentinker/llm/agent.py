"""``LangChainAgent``: LangChain 1.x ``create_agent`` (a LangGraph graph) with tools, rolling memory and
conversations persisted by thread id.

    agent = LangChainAgent(llm="local", tools=[WebSearch(), PythonREPL()], memory_window=5)
    agent.run("What is 17*23? Use python_repl.")

Tool calls the model makes in one turn run concurrently (LangGraph fans them out; ``max_parallel_tools``
bounds the thread pool), keep their call ids, and a failing tool becomes an error ``ToolMessage`` the model
reads instead of an exception. State lives in a LangGraph checkpointer: SQLite under the data dir by default,
so a restarted process continues a thread where it stopped.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.errors import GraphRecursionError

from opentinker.envs.tool_calls import DEFAULT_SYSTEM_PROMPT

from .memory import RollingMemoryMiddleware, Summarizer, extractive_summary
from .models import resolve_chat_model


@dataclass(frozen=True)
class ToolCallRecord:
    """One tool call of a turn, as executed."""

    id: str
    name: str
    args: dict
    status: str
    """"success" or "error" (the error text is in ``content``)."""
    content: str
    latency_s: float | None
    started_at: float | None
    finished_at: float | None


@dataclass(frozen=True)
class AgentReply:
    """The outcome of one ``chat`` turn."""

    text: str
    thread_id: str
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    input_tokens: int = 0
    output_tokens: int = 0
    summary: str = ""


class ToolGuardMiddleware(AgentMiddleware):
    """Times every tool call and turns exceptions into error ``ToolMessage``s (the model sees them, the run goes on)."""

    def wrap_tool_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        call = request.tool_call
        started = time.time()
        try:
            result = handler(request)
        except Exception as exc:
            result = ToolMessage(
                content=f"Error: {type(exc).__name__}: {exc}",
                tool_call_id=call["id"],
                name=call["name"],
                status="error",
            )
        finished = time.time()
        if isinstance(result, ToolMessage):
            result.response_metadata = {
                **result.response_metadata,
                "started_at": started,
                "finished_at": finished,
                "latency_s": finished - started,
            }
        return result


class LangChainAgent:
    """A tool-using chat agent with a rolling memory window and persisted threads."""

    def __init__(
        self,
        llm: str | BaseChatModel | None = "local",
        tools: Sequence[Any] = (),
        *,
        memory_window: int = 5,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        checkpointer: str | Path | BaseCheckpointSaver | None = None,
        thread_id: str | None = None,
        summarizer: Summarizer = extractive_summary,
        max_parallel_tools: int = 4,
        max_steps: int = 6,
        base_url: str | None = None,
        api_key: str | None = None,
    ):
        """
        Args:
            llm: a chat model, ``"local"`` (bundled SmolLM2), ``"scripted"``, or ``"provider:model"`` (see ``models``).
            tools: LangChain tools (``WebSearch()``, ``PythonREPL()``, ``PolicyTool(...)``, ``@tool`` functions).
            memory_window: user turns kept verbatim; older ones are folded into the running summary.
            checkpointer: where threads persist: a path or ``sqlite:///path`` (SQLite), ``"memory"`` (this
                process only), any LangGraph ``BaseCheckpointSaver``, or None for ``<data_dir>/agents/threads.sqlite``.
            thread_id: the thread ``run()`` uses when none is given (default: a new random one).
            summarizer: ``(previous_summary, dropped_messages) -> summary``; ``memory.llm_summarizer(model)`` for prose.
            max_parallel_tools: at most this many tool calls of one turn run at the same time.
            max_steps: model calls per turn before the agent gives up.
            base_url, api_key: an OpenAI-compatible server (vLLM, Ollama, llama.cpp) for ``llm``.
        """
        if not isinstance(max_parallel_tools, int) or max_parallel_tools < 1:
            raise ValueError(f"max_parallel_tools: expected an integer >= 1, got {max_parallel_tools!r}")
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps: expected an integer >= 1, got {max_steps!r}")
        self.model = resolve_chat_model(llm, base_url=base_url, api_key=api_key)
        self.tools = list(tools)
        self.memory_window = memory_window
        self.thread_id = thread_id or uuid.uuid4().hex
        self.max_parallel_tools = max_parallel_tools
        self.max_steps = max_steps
        self.checkpointer = _make_checkpointer(checkpointer)
        self._owns_checkpointer = not isinstance(checkpointer, BaseCheckpointSaver)
        self.graph = create_agent(
            self.model,
            self.tools,
            system_prompt=system_prompt,
            middleware=[RollingMemoryMiddleware(memory_window, summarizer), ToolGuardMiddleware()],
            checkpointer=self.checkpointer,
        )

    def run(self, message: str, thread_id: str | None = None) -> str:
        """Send one user message; returns the final answer text."""
        return self.chat(message, thread_id).text

    def chat(self, message: str, thread_id: str | None = None, config: dict | None = None) -> AgentReply:
        """One turn on ``thread_id`` (default: the agent's own thread), with what happened in it.

        ``config`` is merged into the LangGraph run config (e.g. ``{"callbacks": [...]}`` for tracing).
        """
        if not isinstance(message, str) or not message.strip():
            raise ValueError("message: expected a non-empty string")
        thread = thread_id or self.thread_id
        run_config = {
            "configurable": {"thread_id": thread},
            "max_concurrency": self.max_parallel_tools,
            "recursion_limit": 3 * self.max_steps + 2,
            **(config or {}),
        }
        before = {m.id for m in self.history(thread)[0]}
        try:
            state = self.graph.invoke({"messages": [HumanMessage(message)]}, run_config)
        except GraphRecursionError:
            state = self.graph.get_state(run_config).values
            return _reply(
                state, before, thread, stopped=f"[stopped after {self.max_steps} steps without a final answer]"
            )
        return _reply(state, before, thread)

    def history(self, thread_id: str | None = None) -> tuple[list[BaseMessage], str]:
        """The messages still in the window for a thread, and the summary of older ones."""
        values = self.graph.get_state({"configurable": {"thread_id": thread_id or self.thread_id}}).values
        return list(values.get("messages", [])), values.get("summary", "")

    def close(self) -> None:
        """Close the SQLite connection this agent opened (a checkpointer passed in is left to its owner)."""
        conn = getattr(self.checkpointer, "conn", None)
        if conn is not None and self._owns_checkpointer:
            conn.close()


def _make_checkpointer(spec: str | Path | BaseCheckpointSaver | None) -> BaseCheckpointSaver:
    if isinstance(spec, BaseCheckpointSaver):
        return spec
    if spec == "memory":
        return InMemorySaver()
    if spec is None:
        from opentinker.infra.settings import get_settings

        path = get_settings().resolved_data_dir / "agents" / "threads.sqlite"
    elif isinstance(spec, (str, Path)):
        path = Path(str(spec).removeprefix("sqlite:///"))
    else:
        raise TypeError(f"checkpointer: expected a path, 'memory' or a BaseCheckpointSaver, got {type(spec).__name__}")
    from langgraph.checkpoint.sqlite import SqliteSaver

    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")  # committed turns survive a killed process; readers never block
    return SqliteSaver(conn)


def _reply(state: dict, before: set, thread: str, stopped: str | None = None) -> AgentReply:
    """Collect this turn's final answer, tool calls (with latencies) and token usage from the new messages."""
    new = [m for m in state.get("messages", []) if m.id not in before]
    results = {m.tool_call_id: m for m in new if isinstance(m, ToolMessage)}
    records, tokens_in, tokens_out = [], 0, 0
    for message in new:
        if not isinstance(message, AIMessage):
            continue
        usage = message.usage_metadata or {}
        tokens_in += usage.get("input_tokens", 0)
        tokens_out += usage.get("output_tokens", 0)
        for call in message.tool_calls:
            result = results.get(call["id"])
            meta = result.response_metadata if result is not None else {}
            records.append(
                ToolCallRecord(
                    id=call["id"],
                    name=call["name"],
                    args=call["args"],
                    status=(result.status if result is not None else "error"),
                    content=(str(result.content) if result is not None else "no result"),
                    latency_s=meta.get("latency_s"),
                    started_at=meta.get("started_at"),
                    finished_at=meta.get("finished_at"),
                )
            )
    final = next((m for m in reversed(new) if isinstance(m, AIMessage) and not m.tool_calls), None)
    text = stopped or (final.text if final is not None else "")
    if final is not None and not text and final.invalid_tool_calls:
        text = "[the model produced an invalid tool call: " + final.invalid_tool_calls[0].get("error", "") + "]"
    return AgentReply(
        text=text,
        thread_id=thread,
        tool_calls=records,
        input_tokens=tokens_in,
        output_tokens=tokens_out,
        summary=state.get("summary", ""),
    )
