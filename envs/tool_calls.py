"""The tool-call text format of the env contract: how a text env's tools are shown to a model and how its reply
is read back. A reply calls tools with ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (several
blocks: parallel calls); results come back as ``<tool_result name="...">...</tool_result>``. Text envs, the chat
models that serve a trained policy and GRPO's rollouts all use this one format, so training and serving match.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence

from langchain_core.messages import AIMessage

DEFAULT_SYSTEM_PROMPT = "You are OpenTinker's assistant. Use the tools when they help; answer briefly."
"""What a served agent sends, and what the shipped text tasks train with: the same prompt."""
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)
_EXAMPLES = {
    "python_repl": ("Use python_repl to compute 2**10.", {"code": "print(2**10)"}, "1024", "The answer is 1024."),
    "web_search": (
        "Search the docs for ray.",
        {"query": "ray"},
        "[1] Ray runs the rollouts.",
        "Ray runs the rollouts.",
    ),
}


def system_message(tools: Sequence[dict], system: str = "") -> str:
    """The system turn: the tool format first (a 135M model follows what it reads first most reliably)."""
    if tools:
        system = _tool_instructions(tools) + ("\n\n" + system if system else "")
    return system or "You are a helpful assistant."


def _tool_instructions(tools: Sequence[dict]) -> str:
    lines = [
        f'You can call tools. To call one, reply only with {OPEN}{{"name": TOOL, "arguments": {{...}}}}{CLOSE}.',
        "Tools:",
    ]
    for tool in tools:
        params = ", ".join(
            f'"{k}": {v.get("type", "any")}' for k, v in tool.get("parameters", {}).get("properties", {}).items()
        )
        summary = tool["description"].splitlines()[0] if tool.get("description") else ""
        lines.append(f"- {tool['name']} {{{params}}}: {summary}")
    lines.append("After a tool result, answer the user in one short sentence.")
    return "\n".join(lines)


def worked_examples(tools: Sequence[dict]) -> list[dict]:
    """A worked call → result → answer exchange per (up to two) bound tools: the model copies the pattern."""
    chat = []
    for tool in list(tools)[:2]:
        name = tool["name"]
        params = list(tool.get("parameters", {}).get("properties", {}))
        task, args, result, answer = _EXAMPLES.get(
            name, (f"Use {name}.", {p: "example" for p in params[:1]}, "done", "It is done.")
        )
        chat += [
            {"role": "user", "content": task},
            {"role": "assistant", "content": f"{OPEN}{json.dumps({'name': name, 'arguments': args})}{CLOSE}"},
            {"role": "user", "content": tool_result(name, result)},
            {"role": "assistant", "content": answer},
        ]
    return chat


def tool_result(name: str, text: str) -> str:
    """One tool's output as the model reads it."""
    return f'<tool_result name="{name}">{text}</tool_result>'


def parse_reply(text: str, names: list[str]) -> AIMessage:
    """A reply's ``<tool_call>`` blocks as ``tool_calls`` (unknown tools, broken JSON → ``invalid_tool_calls``)."""
    calls, invalid = [], []
    for raw in _BLOCK.findall(text):
        call_id = f"call_{uuid.uuid4().hex[:12]}"
        try:
            payload = json.loads(_balance(raw.strip()))
            name, args = payload["name"], payload.get("arguments", {})
            if name not in names or not isinstance(args, dict):
                raise ValueError(f"unknown tool {name!r} or arguments not an object")
            calls.append({"name": name, "args": args, "id": call_id, "type": "tool_call"})
        except (ValueError, KeyError, TypeError) as exc:
            invalid.append({"name": None, "args": raw, "id": call_id, "error": str(exc), "type": "invalid_tool_call"})
    if OPEN in text and not calls and not invalid:  # an unterminated block (ran out of tokens)
        invalid.append(
            {
                "name": None,
                "args": text,
                "id": f"call_{uuid.uuid4().hex[:12]}",
                "error": "tool call not closed",
                "type": "invalid_tool_call",
            }
        )
    content = _BLOCK.sub("", text).strip() if (calls or invalid) else text
    return AIMessage(content=content, tool_calls=calls, invalid_tool_calls=invalid)


def _balance(raw: str) -> str:
    """Close braces a small model forgot (``{"name": .., "arguments": {..}`` → one more ``}``)."""
    missing = raw.count("{") - raw.count("}")
    return raw + "}" * missing if missing > 0 else raw
