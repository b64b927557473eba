"""Text envs on the ``BaseEnv`` contract: the observation is a message, the action is the model's reply.

``reset(options={"index": i})`` starts episode ``i`` of the env's prompt set (else a seeded random one) and
returns the user prompt. ``step(reply)``:
- a reply with ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks runs each call with the env's
  tools (the project's ``PythonREPL``/``WebSearch`` or any LangChain tool) and returns the results as the next
  observation, formatted as the chat model shows them (``<tool_result name="...">...</tool_result>``);
  a malformed or unknown call costs ``invalid_call_reward`` and its error is shown instead;
- any other reply is the final answer: ``reward_fn(answer, example)`` (plain Python, in this process) and the
  episode terminates; past ``max_turns`` replies the episode is truncated.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import gymnasium as gym

from opentinker.envs.base import BaseEnv
from opentinker.envs.tool_calls import parse_reply, system_message, tool_result, worked_examples

CHARSET = frozenset(string.printable)
MAX_CHARS = 8192
"""Longest observation/action (characters) the spaces admit; longer tool output is cut."""
TOOL_RESULT_CHARS = 500
"""Tool output shown to the model per call (the chat model's ``max_tool_result_chars``)."""
_INT = re.compile(r"-?\d[\d,]*")


@dataclass(frozen=True)
class TextExample:
    """One prompt and what its verifier needs (the expected answer, or anything else)."""

    prompt: str
    answer: str
    meta: dict = field(default_factory=dict)


RewardFn = Callable[[str, TextExample], float]


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` (thousands separators allowed), or None."""
    found = _INT.findall(text)
    if not found:
        return None
    try:
        return int(found[-1].replace(",", ""))
    except ValueError:
        return None


def exact_integer(answer: str, example: TextExample) -> float:
    """1.0 when the last integer of the answer is the expected one, else 0.0."""
    return float(last_integer(answer) == int(example.answer))


def printable(text: str, limit: int = MAX_CHARS) -> str:
    """``text`` inside the spaces' charset (other characters become '?') and length."""
    return "".join(c if c in CHARSET else "?" for c in text[:limit])


class TextEnv(BaseEnv):
    """A prompt set + a verifier, with optional tool use over several turns (see the module docstring)."""

    metadata: ClassVar[dict] = {"render_modes": []}

    def __init__(
        self,
        examples: Sequence[TextExample],
        reward_fn: RewardFn = exact_integer,
        tools: Sequence[Any] = (),
        max_turns: int = 1,
        system_prompt: str = "",
        invalid_call_reward: float = -0.1,
        worked_examples: bool = False,
    ):
        if not examples:
            raise ValueError("examples: expected at least one TextExample")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns: expected an integer >= 1, got {max_turns!r}")
        self.examples = list(examples)
        self.reward_fn = reward_fn
        self.tools = {tool.name: tool for tool in tools}
        self.max_turns = max_turns
        self.invalid_call_reward = float(invalid_call_reward)
        self.system_prompt = chat_system_prompt(list(tools), system_prompt)
        self.worked_examples = worked_examples
        self.prefix = chat_examples(list(tools)) if worked_examples else []
        """Turns shown between the system prompt and the task (the chat model's worked tool-call examples)."""
        self.observation_space = gym.spaces.Text(MAX_CHARS, min_length=0, charset="".join(sorted(CHARSET)))
        self.action_space = gym.spaces.Text(MAX_CHARS, min_length=0, charset="".join(sorted(CHARSET)))
        self.example: TextExample = self.examples[0]
        self.index = 0
        self.turn = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        index = (options or {}).get("index")
        n = len(self.examples)
        self.index = int(self.np_random.integers(n)) if index is None else int(index) % n
        self.example, self.turn = self.examples[self.index], 0
        return printable(self.example.prompt), {"index": self.index}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.turn += 1
        message = parse_reply(str(action), list(self.tools))
        info: dict[str, Any] = {
            "index": self.index,
            "turn": self.turn,
            "tool_calls": [],
            "invalid_tool_calls": 0,
            "success": False,
        }
        if not message.tool_calls and not message.invalid_tool_calls:
            reward = float(self.reward_fn(str(action), self.example))
            info.update(answer=str(action), success=reward > 0)
            return "", reward, True, False, info
        blocks, reward = [], 0.0
        for call in message.tool_calls:
            result = self._run_tool(call["name"], call["args"])
            info["tool_calls"].append({"name": call["name"], "args": call["args"], "result": result})
            blocks.append(tool_result(call["name"], result[:TOOL_RESULT_CHARS]))
        for call in message.invalid_tool_calls:
            reward += self.invalid_call_reward
            info["invalid_tool_calls"] += 1
            blocks.append(tool_result("error", f"invalid tool call: {call.get('error', '')}"))
        truncated = self.turn >= self.max_turns
        return printable("\n".join(blocks)), reward, False, truncated, info

    def _run_tool(self, name: str, args: dict) -> str:
        """The tool's output as text; a failing tool's error is shown to the model, never raised."""
        try:
            return str(self.tools[name].invoke(args))
        except Exception as exc:
            return f"Error: {type(exc).__name__}: {exc}"


def _specs(tools: Sequence[Any]) -> list[dict]:
    from langchain_core.utils.function_calling import convert_to_openai_tool

    return [convert_to_openai_tool(t)["function"] for t in tools]


def chat_examples(tools: Sequence[Any]) -> list[dict]:
    """The worked call → result → answer turns ``LocalChatModel`` shows for these tools."""
    return worked_examples(_specs(tools))


def chat_system_prompt(tools: Sequence[Any], system_prompt: str = "") -> str:
    """The system message the chat model writes for these tools (training and serving see the same text)."""
    return system_message(_specs(tools), system_prompt)
