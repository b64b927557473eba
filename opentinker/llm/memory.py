"""Rolling conversation memory: the last ``window`` turns verbatim, older turns folded into a running summary.

A turn starts at a user message and runs to the next one (tool calls and results stay with their turn, so
a window never splits an AI tool call from its results). Messages that fall out of the window are removed
from the persisted state and summarised; the summary is shown to the model in its system message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NotRequired

from langchain.agents.middleware import AgentMiddleware, AgentState
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, RemoveMessage, SystemMessage, ToolMessage

SUMMARY_HEADER = "Summary of the earlier conversation:"

Summarizer = Callable[[str, Sequence[BaseMessage]], str]


def extractive_summary(
    previous: str, dropped: Sequence[BaseMessage], max_chars: int = 1500, line_chars: int = 160
) -> str:
    """Deterministic, model-free summary: one short line per dropped message, oldest lines cut first."""
    lines = [line for line in previous.splitlines() if line.strip()]
    for message in dropped:
        text = " ".join(_text(message).split())
        if isinstance(message, AIMessage) and message.tool_calls:
            text = (text + " " if text else "") + "called " + ", ".join(c["name"] for c in message.tool_calls)
        if not text:
            continue
        role = {HumanMessage: "user", AIMessage: "assistant", ToolMessage: "tool"}.get(type(message), "note")
        if isinstance(message, ToolMessage):
            role = f"tool {message.name}"
        lines.append(f"- {role}: {text[:line_chars]}{'…' if len(text) > line_chars else ''}")
    while lines and sum(len(line) + 1 for line in lines) > max_chars:
        lines.pop(0)
    return "\n".join(lines)


def llm_summarizer(model: Any, max_words: int = 120) -> Summarizer:
    """Summaries written by a chat model (better prose, one extra model call whenever turns fall out)."""

    def summarize(previous: str, dropped: Sequence[BaseMessage]) -> str:
        transcript = extractive_summary("", dropped, max_chars=6000)
        prompt = (
            f"Update the running summary of a conversation in at most {max_words} words.\n"
            f"Current summary:\n{previous or '(empty)'}\n\nNew messages:\n{transcript}\n\nUpdated summary:"
        )
        return _text(model.invoke([HumanMessage(prompt)])).strip()

    return summarize


class MemoryState(AgentState):
    summary: NotRequired[str]


class RollingMemoryMiddleware(AgentMiddleware):
    """Keeps the last ``window`` turns in state; everything older lives on only in ``state['summary']``."""

    state_schema = MemoryState

    def __init__(self, window: int, summarizer: Summarizer = extractive_summary):
        super().__init__()
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"memory_window: expected an integer >= 1, got {window!r}")
        self.window = window
        self.summarizer = summarizer

    def before_model(self, state: MemoryState, runtime: Any) -> dict[str, Any] | None:
        messages = state["messages"]
        dropped = messages_outside_window(messages, self.window)
        if not dropped:
            return None
        summary = self.summarizer(state.get("summary", ""), dropped)
        return {"messages": [RemoveMessage(id=m.id) for m in dropped], "summary": summary}

    def wrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        summary = request.state.get("summary")
        if summary:
            base = request.system_message.text if request.system_message else ""
            request = request.override(system_message=SystemMessage(f"{base}\n\n{SUMMARY_HEADER}\n{summary}".strip()))
        return handler(request)


def messages_outside_window(messages: Sequence[BaseMessage], window: int) -> list[BaseMessage]:
    """Messages older than the start of the ``window``-th most recent user turn."""
    turn_starts = [i for i, m in enumerate(messages) if isinstance(m, HumanMessage)]
    if len(turn_starts) <= window:
        return []
    return list(messages[: turn_starts[-window]])


def _text(message: BaseMessage) -> str:
    return message.content if isinstance(message.content, str) else message.text
