"""Text-env episodes played by a language model, batched turn by turn, and the worker that plays them.

Sampling goes through the Tinker engine's sampler (``agents.lm_sampler.HFSampler``) on a ``MultiLoraModel``, and is
seeded per group of episodes by (seed, iteration, group): a group is always generated as one batch with its own
seed, so a retried rollout — or the same step on 1 or 2 workers — gives the same completions. Workers receive only
the LoRA adapter's tensors each iteration; the base model is rebuilt from its name.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from opentinker.agents.lm_sampler import HFSampler, SampleJob, SamplingSpec, sample_seed
from opentinker.agents.multi_lora import AdapterShape, MultiLoraModel

POLICY = "policy"
"""The adapter's name on the learner's and the workers' ``MultiLoraModel``."""


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


def sample_turn(
    sampler: HFSampler,
    adapter: str | None,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    temperature: float,
    seed: int | None,
) -> list[list[int]]:
    """One completion per prompt through ``sampler`` (``agents.lm_sampler``, the Tinker engine's), greedy when
    ``temperature`` is 0; each ends at its first end-of-text token (kept) or at ``max_new_tokens``. Equal prompts
    (a group's first turn) are one request with a sample per row: prefilled once, then each row on its own seeded
    stream (``seed`` and the request's place)."""
    requests: dict[tuple[int, ...], list[int]] = {}
    for row, prompt in enumerate(prompts):
        requests.setdefault(tuple(prompt), []).append(row)
    jobs = [
        SampleJob(
            prompt,
            len(rows),
            SamplingSpec(max_new_tokens, temperature, seed=None if seed is None else sample_seed(seed, k)),
            adapter,
        )
        for k, (prompt, rows) in enumerate(requests.items())
    ]
    completions: list[list[int]] = [[] for _ in prompts]
    for result, rows in zip(sampler.sample(jobs), requests.values()):
        for row, completion in zip(rows, result.completions):
            completions[row] = completion.tokens
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
    sampler: HFSampler,
    adapter: str | None,
    envs: Sequence[Any],
    indices: Sequence[int],
    group: int,
    max_new_tokens: int,
    temperature: float,
    seed: int | None,
) -> list[Episode]:
    """Play one episode per env (``reset(options={"index": i})``), all rows sampled together each turn, through
    ``sampler``'s adapter ``adapter`` (None: the base model)."""
    tokenizer = sampler.model.tokenizer
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
        completions = sample_turn(sampler, adapter, prompts, max_new_tokens, temperature, turn_seed)
        still = []
        for i, prompt, completion in zip(active, prompts, completions):
            if take_turn(envs[i], episodes[i], chats[i], tokenizer, prompt, completion):
                still.append(i)
        active, turn = still, turn + 1
    for episode, chat, env in zip(episodes, chats, envs):
        episode.transcript = chat[1 + len(env.prefix) :]
    return episodes


def evaluate_model(
    sampler: HFSampler,
    adapter: str | None,
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
        episodes += play(sampler, adapter, envs[: len(chunk)], chunk, -1, max_new_tokens, 0.0, None)
    return episodes


def adapter_sampler(directory: str, cache_dir: str | None = None) -> tuple[HFSampler, dict]:
    """(a sampler holding a saved adapter folder as ``POLICY`` on its base model, the folder's metadata)."""
    from opentinker.agents.lm_policy import adapter_meta

    meta = adapter_meta(directory)
    model = MultiLoraModel(meta["base_model"], cache_dir)
    model.load(POLICY, directory)
    return HFSampler(model), meta


class LLMRolloutWorker:
    """A rollout actor: the base model with the policy's adapter (``lora``: its ``AdapterShape``) sampled by the
    Tinker engine's sampler, env copies of a text env's splits (``task``: a shipped task, ``module:factory``, a
    factory or an instance), one torch thread."""

    def __init__(
        self, task: Any, task_seed: int, base_model: str, lora: AdapterShape, cache_dir: str | None, threads: int = 1
    ):
        from opentinker.envs.text_tasks import make_text_env

        if threads:
            torch.set_num_threads(threads)
        try:  # Ray starts workers at niceness 15; a rollout is on the learner's critical path (allowed for root)
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        except OSError:
            pass
        self.task, self.task_seed = task, task_seed
        self._make_env = lambda s: make_text_env(task, s, task_seed)
        self.envs: dict[str, list[Any]] = {}
        self.model = MultiLoraModel(base_model, cache_dir)
        self.model.add(POLICY, lora, seed=0)  # its tensors are replaced by the learner's before any rollout
        self.sampler = HFSampler(self.model)

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
        self.model.load_state(POLICY, adapter)
        envs = self._envs("train", group_size)
        episodes = []
        for group, index in groups:
            episodes += play(
                self.sampler,
                POLICY,
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
        envs = self._envs(split, batch)
        if adapter is not None:
            self.model.load_state(POLICY, adapter)
        name = None if adapter is None else POLICY
        return evaluate_model(
            self.sampler, name, self.task, self.task_seed, indices, max_new_tokens, batch, split, envs
        )

    def close(self) -> None:
        pass
