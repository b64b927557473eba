"""A deterministic chat model that emits real tool calls through LangChain's tool-calling interface.

For plumbing tests and offline demos where answers must be exact. The default script reads commands from the
latest user message — ``/python_repl {"code": "print(1)"} /web_search {"query": "ppo"}`` becomes one
``AIMessage`` with two ``tool_calls`` — answers tool results by quoting them, and otherwise reports what it can
see of the conversation (earlier user messages and the memory summary), which makes memory observable.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict

from .memory import SUMMARY_HEADER

Script = Callable[[Sequence[BaseMessage], tuple[str, ...]], AIMessage]
_COMMAND = re.compile(r"(?:^|\s)/([A-Za-z_][\w-]*)\s*(?=\{)")


def command_script(messages: Sequence[BaseMessage], tool_names: tuple[str, ...]) -> AIMessage:
    """The default script (see the module docstring)."""
    last = messages[-1]
    if isinstance(last, ToolMessage):
        results = []
        for message in reversed(messages):
            if not isinstance(message, ToolMessage):
                break
            results.append(f"{message.name}[{message.tool_call_id}]: {message.content}")
        return AIMessage(content="Tool results: " + " | ".join(reversed(results)))
    text = _text(last)
    calls = _parse_commands(text, tool_names, call_prefix=f"call_{len(messages)}")
    if calls:
        return AIMessage(content="", tool_calls=calls)
    earlier = [_text(m) for m in messages[:-1] if isinstance(m, HumanMessage)]
    summary = next(
        (
            _text(m).split(SUMMARY_HEADER, 1)[1].strip()
            for m in messages
            if isinstance(m, SystemMessage) and SUMMARY_HEADER in _text(m)
        ),
        "",
    )
    lines = [f"You said: {text}", f"Earlier: {' || '.join(earlier) if earlier else '(nothing)'}"]
    if summary:
        lines.append(f"Summary: {summary}")
    return AIMessage(content="\n".join(lines))


def _parse_commands(text: str, tool_names: tuple[str, ...], call_prefix: str) -> list[dict]:
    decoder, calls = json.JSONDecoder(), []
    for match in _COMMAND.finditer(text):
        if match.group(1) not in tool_names:
            continue
        try:
            args, _ = decoder.raw_decode(text, match.end())
        except json.JSONDecodeError:
            continue
        if isinstance(args, dict):
            calls.append(
                {"name": match.group(1), "args": args, "id": f"{call_prefix}_{len(calls)}", "type": "tool_call"}
            )
    return calls


def _text(message: BaseMessage) -> str:
    return message.content if isinstance(message.content, str) else message.text


class ScriptedChatModel(BaseChatModel):
    """Chat model whose replies come from ``script(messages, bound_tool_names)``; supports ``bind_tools``."""

    script: Script = command_script
    tool_names: tuple[str, ...] = ()
    model_config = ConfigDict(arbitrary_types_allowed=True)

    @property
    def _llm_type(self) -> str:
        return "opentinker-scripted"

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None, **kwargs: Any) -> ScriptedChatModel:
        names = tuple(convert_to_openai_tool(t)["function"]["name"] for t in tools)
        return self.model_copy(update={"tool_names": names})

    def _generate(
        self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: Any = None, **kwargs: Any
    ) -> ChatResult:
        reply = self.script(messages, self.tool_names)
        prompt_tokens = sum(len(_text(m).split()) for m in messages)
        output_tokens = len(_text(reply).split()) + sum(len(json.dumps(c["args"]).split()) for c in reply.tool_calls)
        reply.usage_metadata = {
            "input_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "total_tokens": prompt_tokens + output_tokens,
        }
        reply.response_metadata = {**reply.response_metadata, "model_name": "scripted"}
        return ChatResult(generations=[ChatGeneration(message=reply)])
