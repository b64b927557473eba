"""Text-env episodes played by a language model, batched turn by turn, and the worker that plays them.

Sampling is seeded per group of episodes by (seed, iteration, group): a group is always generated as one batch
with its own seed, so a retried rollout — or the same step on 1 or 2 workers — gives the same completions.
Workers receive only the LoRA adapter's tensors each iteration; the base model is rebuilt from its name.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class Turn:
    """One model reply: the exact token ids it was conditioned on and generated (stop token included)."""

    prompt_ids: list[int]
    completion_ids: list[int]


@dataclass
class Episode:
    """One played episode and what the pipeline reports about it."""

    group: int
    index: int
    prompt: str
    turns: list[Turn] = field(default_factory=list)
    transcript: list[dict] = field(default_factory=list)
    reward: float = 0.0
    success: bool = False
    tool_calls: int = 0
    invalid_tool_calls: int = 0
    answer: str = ""


def sample_seed(*keys: int) -> int:
    """A 63-bit seed from (seed, iteration, group, ...)."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(2, np.uint64)[0] >> np.uint64(1))


def stop_token_ids(tokenizer: Any) -> list[int]:
    ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    return sorted(i for i in ids if i is not None and i >= 0)


@torch.no_grad()
def generate(
    model: Any, tokenizer: Any, prompts: Sequence[list[int]], max_new_tokens: int, temperature: float, seed: int | None
) -> list[list[int]]:
    """Completions for a batch of token-id prompts (left-padded, KV-cached ``generate``); greedy when
    ``temperature`` is 0. Each completion ends at its first stop token (kept) or at ``max_new_tokens``."""
    pad = tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    stops = stop_token_ids(tokenizer)
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    )
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention,
        max_new_tokens=max_new_tokens,
        eos_token_id=stops,
        pad_token_id=pad,
        **sampling,
    )
    completions = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        completions.append(row[:end])
    return completions


def open_episode(env: Any, index: int, group: int) -> tuple[Episode, list[dict]]:
    """Reset ``env`` to prompt ``index``: the new episode and its chat (system prompt, the env's prefix, the prompt)."""
    obs, info = env.reset(options={"index": int(index)})
    chat = [{"role": "system", "content": env.system_prompt}, *env.prefix, {"role": "user", "content": obs}]
    return Episode(group=group, index=info["index"], prompt=obs), chat


def chat_prompt_ids(tokenizer: Any, chat: list[dict]) -> list[int]:
    """The token ids the model is prompted with: the chat so far, the assistant's turn opened."""
    return tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]


def take_turn(
    env: Any, episode: Episode, chat: list[dict], tokenizer: Any, prompt_ids: list[int], completion_ids: list[int]
) -> bool:
    """Step ``env`` with the decoded reply and record the turn in ``episode`` and ``chat``; True while it goes on."""
    text = tokenizer.decode(completion_ids, skip_special_tokens=True).strip()
    obs, reward, terminated, truncated, info = env.step(text)
    episode.turns.append(Turn(list(prompt_ids), list(completion_ids)))
    episode.reward += float(reward)
    episode.tool_calls += len(info["tool_calls"])
    episode.invalid_tool_calls += info["invalid_tool_calls"]
    chat.append({"role": "assistant", "content": text})
    if terminated or truncated:
        episode.success, episode.answer = bool(info["success"]), info.get("answer", "")
        return False
    chat.append({"role": "user", "content": obs})
    return True


def play(
    model: Any,
    tokenizer: Any,
    envs: Sequence[Any],
    indices: Sequence[int],
    group: int,
    max_new_tokens: int,
    temperature: float,
    seed: int | None,
) -> list[Episode]:
    """Play one episode per env (``reset(options={"index": i})``), all rows sampled together each turn."""
    episodes, chats = [], []
    for env, index in zip(envs, indices):
        episode, chat = open_episode(env, index, group)
        episodes.append(episode)
        chats.append(chat)
    active = list(range(len(envs)))
    turn = 0
    while active:
        prompts = [chat_prompt_ids(tokenizer, chats[i]) for i in active]
        turn_seed = None if seed is None else sample_seed(seed, turn)
        completions = generate(model, tokenizer, prompts, max_new_tokens, temperature, turn_seed)
        still = []
        for i, prompt, completion in zip(active, prompts, completions):
            if take_turn(envs[i], episodes[i], chats[i], tokenizer, prompt, completion):
                still.append(i)
        active, turn = still, turn + 1
    for episode, chat, env in zip(episodes, chats, envs):
        episode.transcript = chat[1 + len(env.prefix) :]
    return episodes


def evaluate_model(
    model: Any,
    tokenizer: Any,
    task: Any,
    task_seed: int,
    indices: list[int],
    max_new_tokens: int,
    batch: int,
    split: str = "heldout",
    envs: list[Any] | None = None,
) -> list[Episode]:
    """Greedy episodes on ``indices`` of a text env's split (``task``: ``make_text_env``'s source), ``batch`` at a
    time."""
    from opentinker.envs.text_tasks import make_text_env

    envs = envs or [make_text_env(task, split, task_seed) for _ in range(min(batch, len(indices)))]
    episodes = []
    for start in range(0, len(indices), batch):
        chunk = indices[start : start + batch]
        episodes += play(model, tokenizer, envs[: len(chunk)], chunk, -1, max_new_tokens, 0.0, None)
    return episodes


class LLMRolloutWorker:
    """A rollout actor: the base model + LoRA adapter, env copies of a text env's splits (``task``: a shipped task,
    ``module:factory``, a factory or an instance), one torch thread."""

    def __init__(self, task: Any, task_seed: int, base_model: str, lora: Any, cache_dir: str | None, threads: int = 1):
        from opentinker.envs.text_tasks import make_text_env

        from .lm_policy import add_lora, load_base_model

        if threads:
            torch.set_num_threads(threads)
        try:  # Ray starts workers at niceness 15; a rollout is on the learner's critical path (allowed for root)
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        except OSError:
            pass
        self.task, self.task_seed = task, task_seed
        self._make_env = lambda s: make_text_env(task, s, task_seed)
        self.envs: dict[str, list[Any]] = {}
        model, self.tokenizer = load_base_model(base_model, cache_dir)
        self.model = add_lora(model, lora, seed=0)  # its A/B are replaced by set_adapter before any rollout
        self.model.eval()

    def pid(self) -> int:
        return os.getpid()

    def _envs(self, split: str, n: int) -> list[Any]:
        pool = self.envs.setdefault(split, [])
        while len(pool) < n:
            pool.append(self._make_env(split))
        return pool[:n]

    def collect(
        self,
        adapter: dict,
        iteration: int,
        seed: int,
        groups: list[tuple[int, int]],
        group_size: int,
        max_new_tokens: int,
        temperature: float,
    ) -> list[Episode]:
        """``group_size`` sampled episodes of each (group id, prompt index), each group seeded on its own."""
        from .lm_policy import load_adapter_state

        load_adapter_state(self.model, adapter)
        envs = self._envs("train", group_size)
        episodes = []
        for group, index in groups:
            episodes += play(
                self.model,
                self.tokenizer,
                envs,
                [index] * group_size,
                group,
                max_new_tokens,
                temperature,
                sample_seed(seed, iteration, group),
            )
        return episodes

    def evaluate(
        self, adapter: dict | None, split: str, indices: list[int], max_new_tokens: int, batch: int
    ) -> list[Episode]:
        """Greedy episodes on ``indices`` of ``split`` (adapter None: the base model alone)."""
        from .lm_policy import load_adapter_state

        envs = self._envs(split, batch)
        if adapter is not None:
            load_adapter_state(self.model, adapter)
        with self.model.disable_adapter() if adapter is None else contextlib.nullcontext():
            return evaluate_model(
                self.model, self.tokenizer, self.task, self.task_seed, indices, max_new_tokens, batch, split, envs
            )

    def close(self) -> None:
        pass
