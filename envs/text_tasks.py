"""Shipped text tasks, generated offline from a seed, with fixed train / held-out splits.

- ``arithmetic``: two-number addition/subtraction; the reward is 1 for the exact answer; ``python_repl`` may be used
  (a tool call, its result, then the answer: two turns at most).
- ``tool_arithmetic``: products of two 4-digit numbers — beyond what a small model computes in its head, so the
  answer needs ``python_repl``'s result (three turns at most).

``make_text_env("arithmetic", split="heldout")`` builds the env; ``opentinker train arithmetic --algo grpo`` trains on
the ``train`` split and evaluates on ``heldout``. The two splits never share a question. Your own text env (prompts,
verifier, tools) trains the same way as ``package.module:factory`` (``user_text_env``).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import numpy as np

from opentinker.envs.base import import_env
from opentinker.envs.errors import EnvSpecError
from opentinker.envs.text import RewardFn, TextEnv, TextExample, exact_integer
from opentinker.envs.tool_calls import DEFAULT_SYSTEM_PROMPT

SPLITS = ("train", "heldout")
TextEnvSource = Any
"""A text env as runs name it: a shipped task, ``"module:factory"``, a factory (``split`` -> TextEnv) or an instance."""
TOOLS_GROUP = "opentinker.text_tools"
"""Entry-point group of tool factories (name -> zero-argument callable) a task's ``tools`` are looked up in."""


@dataclass(frozen=True)
class TextTaskSpec:
    """How to build one shipped task."""

    name: str
    description: str
    generate: Callable[[np.random.Generator, int], list[TextExample]]
    """(rng, n) -> n distinct examples."""
    tools: tuple[str, ...]
    max_turns: int
    size: tuple[int, int] = (512, 64)
    """Examples in the train and held-out splits."""
    reward_fn: RewardFn = exact_integer
    """Plain Python, run in the env's process: (final answer, example) -> reward."""


def _arithmetic(rng: np.random.Generator, n: int) -> list[TextExample]:
    seen, out = set(), []
    while len(out) < n:
        a, b = (int(x) for x in rng.integers(10, 100, size=2))
        op = "+" if rng.random() < 0.5 else "-"
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        out.append(TextExample(f"What is {a} {op} {b}?", str(a + b if op == "+" else a - b)))
    return out


def _tool_arithmetic(rng: np.random.Generator, n: int) -> list[TextExample]:
    seen, out = set(), []
    while len(out) < n:
        a, b = (int(x) for x in rng.integers(1000, 10000, size=2))
        if (a, b) in seen:
            continue
        seen.add((a, b))
        out.append(TextExample(f"Use python_repl to compute {a} * {b}, then give the result.", str(a * b)))
    return out


TEXT_TASKS: dict[str, TextTaskSpec] = {
    spec.name: spec
    for spec in (
        TextTaskSpec(
            "arithmetic",
            "two-digit addition/subtraction, exact answer; python_repl allowed",
            _arithmetic,
            ("python_repl",),
            max_turns=2,
        ),
        TextTaskSpec(
            "tool_arithmetic",
            "4-digit products: the answer needs python_repl's result",
            _tool_arithmetic,
            ("python_repl",),
            max_turns=3,
        ),
    )
}


def text_task(name: str) -> TextTaskSpec:
    """The spec of a shipped task; an unknown name is an error listing the known ones."""
    if name not in TEXT_TASKS:
        raise EnvSpecError(f"task: unknown text task {name!r} (expected one of: {', '.join(sorted(TEXT_TASKS))})")
    return TEXT_TASKS[name]


def task_examples(name: str, split: str = "train", seed: int = 0) -> list[TextExample]:
    """The examples of one split: both splits come from one seeded draw, so they never overlap."""
    spec = text_task(name)
    if split not in SPLITS:
        raise EnvSpecError(f"split: expected one of {SPLITS}, got {split!r}")
    n_train, n_heldout = spec.size
    examples = spec.generate(np.random.default_rng(seed), n_train + n_heldout)
    return examples[:n_train] if split == "train" else examples[n_train:]


def task_tools(names: tuple[str, ...]) -> list[Any]:
    """Fresh tools for a task's names, from the factories installed under ``TOOLS_GROUP`` (the env contract names
    tools; whoever ships them registers them, so envs never imports the LLM area)."""
    found = {ep.name: ep for ep in entry_points(group=TOOLS_GROUP)}
    missing = [name for name in names if name not in found]
    if missing:
        raise EnvSpecError(
            f"tools: no tool {missing[0]!r} is installed (entry points {TOOLS_GROUP!r}: {', '.join(sorted(found))}); "
            "reinstall opentinker, or pass tools= to make_text_env"
        )
    return [found[name].load()() for name in names]


def make_text_env(name: TextEnvSource, split: str = "train", seed: int = 0, **overrides: Any) -> TextEnv:
    """A ``TextEnv`` over one split of a text env: a shipped task's name (``overrides``: TextEnv arguments, e.g.
    ``tools``), or your own: ``"package.module:factory"``, the factory itself or an instance (``user_text_env``)."""
    if not isinstance(name, str) or ":" in name:
        return user_text_env(import_env(name) if isinstance(name, str) else name, split, seed)
    spec = text_task(name)
    kwargs = {
        "reward_fn": spec.reward_fn,
        "max_turns": spec.max_turns,
        "system_prompt": DEFAULT_SYSTEM_PROMPT,  # what a served agent sends: same prompt as trained
        **overrides,
    }
    if "tools" not in kwargs:
        kwargs["tools"] = task_tools(spec.tools)
    return TextEnv(task_examples(name, split, seed), **kwargs)


def user_text_env(factory: Callable[..., TextEnv] | TextEnv, split: str = "train", seed: int = 0) -> TextEnv:
    """Your text env: a factory (function or ``TextEnv`` subclass) called with ``split`` ("train" or "heldout": its
    held-out prompts, which GRPO evaluates on) and ``seed`` where it takes them; one taking neither serves both
    splits. A ``TextEnv`` instance is copied (each rollout worker plays several episodes at once)."""
    if isinstance(factory, TextEnv):
        return copy.deepcopy(factory)
    if isinstance(factory, str) or not callable(factory):
        raise EnvSpecError(f"env: expected a TextEnv, its class or a factory returning one, got {factory!r}")
    if split not in SPLITS:
        raise EnvSpecError(f"split: expected one of {SPLITS}, got {split!r}")
    accepted = inspect.signature(factory).parameters
    kwargs = {key: value for key, value in (("split", split), ("seed", seed)) if key in accepted}
    env = factory(**kwargs)
    if not isinstance(env, TextEnv):
        name = getattr(factory, "__qualname__", repr(factory))
        raise EnvSpecError(f"env: {name} returned a {type(env).__name__}, expected a TextEnv (envs.text.TextEnv)")
    return env


def text_env_name(env: Any) -> str:
    """The name a run records for a text env: a shipped task's or ``module:qualname`` of a factory."""
    if isinstance(env, str):
        return env
    source = type(env) if isinstance(env, TextEnv) else env
    return f"{source.__module__}:{source.__qualname__}"
