"""Batched sampling with a KV cache: many requests at once, each with its own adapter, seed and stop rules.

The requests' prompts are prefilled together (left-padded, one forward), each prompt's cache is repeated for its
``num_samples`` rows, then all rows decode token by token; a row leaves the batch (and the cache) when it stops, and
requests that arrive meanwhile join it between two steps (``join``: prefilled, their cache left-padded and merged).
Per row: temperature (0: greedy), top-k, top-p, a ``torch.Generator`` seeded from (seed, sample index), stop token
ids and stop strings. Reported logprobs are the model's own (temperature 1, before top-k/top-p): the numbers the
trainer's forward gives for the same tokens, so an importance ratio starts at 1.

``Sampler`` is the seam for other engines. ``HFSampler`` runs transformers + peft (CPU or CUDA). A vLLM sampler
(the field's standard on GPUs, multi-LoRA serving with a ``LoRARequest`` per adapter folder written by
``MultiLoraModel.save``) would implement the same ``sample`` (its own continuous batching behind ``join`` and
``done``) and ``add``/``remove`` of sampler adapters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from opentinker.agents.multi_lora import BASE, MultiLoraModel

MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_TOPK = 20


def sample_seed(*keys: int) -> int:
    """A 63-bit seed from (seed, iteration, group, ...)."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(2, np.uint64)[0] >> np.uint64(1))


def stop_token_ids(tokenizer: Any) -> list[int]:
    """The tokens that end a reply (end of text, the chat template's end of turn)."""
    ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    return sorted(i for i in ids if i is not None and i >= 0)


class SamplingError(ValueError):
    """A request the sampler cannot run: the message names the field and what was expected."""


@dataclass(frozen=True)
class SamplingSpec:
    """How one request samples (Tinker's ``SamplingParams``)."""

    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    """<= 0: no limit."""
    top_p: float = 1.0
    seed: int | None = None
    stop_tokens: tuple[int, ...] = ()
    """Token ids that end a row (kept as its last token), besides the end-of-text ones when ``stop_at_eos``."""
    stop_strings: tuple[str, ...] = ()
    """A row ends once its decoded text contains one of these."""
    stop_at_eos: bool = True
    """The model's end-of-text tokens end a row (Tinker's ``stop=[]`` turns this off: only max_tokens ends it)."""


@dataclass(frozen=True)
class SampleJob:
    """One request: ``num_samples`` completions of ``prompt`` from ``adapter`` (None: the base model)."""

    prompt: Sequence[int]
    num_samples: int
    spec: SamplingSpec
    adapter: str | None = None
    prompt_logprobs: bool = False
    topk_prompt: int = 0
    topk_sample: int = 0


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[tuple[list[int], list[float]]] = field(default_factory=list)
    stop_reason: str = "length"
    """"stop" (a stop token or string ended it) or "length" (max_tokens or the context ran out)."""


@dataclass
class SampleResult:
    completions: list[Completion]
    prompt_logprobs: np.ndarray | None = None
    """float32 (len(prompt),), NaN at position 0 (nothing before it)."""
    prompt_topk: tuple[np.ndarray, np.ndarray] | None = None
    """(token ids, logprobs), each (len(prompt), k); position 0 holds id 0 and -99999 (Tinker's empty cell)."""


class Sampler(Protocol):
    def sample(
        self,
        jobs: Sequence[SampleJob],
        join: Callable[[int], Sequence[SampleJob]] | None = None,
        done: Callable[[int, SampleResult], None] | None = None,
    ) -> list[SampleResult]: ...


def check_job(job: SampleJob, vocab_size: int, max_context: int) -> None:
    """Refuse what the sampler cannot do, naming the field (before any compute)."""
    spec = job.spec
    n = len(job.prompt)
    if n == 0:
        raise SamplingError("prompt: expected at least one token")
    if min(job.prompt) < 0 or max(job.prompt) >= vocab_size:
        raise SamplingError(f"prompt: token ids must be in [0, {vocab_size})")
    if not 1 <= job.num_samples <= 256:
        raise SamplingError(f"num_samples must be in [1, 256], got {job.num_samples}")
    if not isinstance(spec.max_tokens, int) or spec.max_tokens < 1:
        raise SamplingError(f"sampling_params.max_tokens must be an int >= 1, got {spec.max_tokens!r}")
    if n + spec.max_tokens > max_context:
        raise SamplingError(
            f"prompt: {n} tokens + max_tokens {spec.max_tokens} exceed the model's context of {max_context}"
        )
    if not (math.isfinite(spec.temperature) and spec.temperature >= 0):
        raise SamplingError(f"sampling_params.temperature must be >= 0, got {spec.temperature}")
    if not 0 < spec.top_p <= 1:
        raise SamplingError(f"sampling_params.top_p must be in (0, 1], got {spec.top_p}")
    stops = list(spec.stop_tokens) + list(spec.stop_strings)
    if len(stops) > MAX_STOPS:
        raise SamplingError(f"sampling_params.stop: at most {MAX_STOPS} stop sequences, got {len(stops)}")
    for token in spec.stop_tokens:
        if not 0 <= token < vocab_size:
            raise SamplingError(f"sampling_params.stop: token id {token} is not in [0, {vocab_size})")
    for text in spec.stop_strings:
        if not text or len(text) > MAX_STOP_CHARS:
            raise SamplingError(
                f"sampling_params.stop: stop strings must be 1-{MAX_STOP_CHARS} characters, got {text!r}"
            )
    for name in ("topk_prompt", "topk_sample"):
        if not 0 <= getattr(job, name) <= MAX_TOPK:
            raise SamplingError(f"{name}_logprobs must be in [0, {MAX_TOPK}], got {getattr(job, name)}")


class HFSampler:
    """Sampling on a ``MultiLoraModel`` (its adapters by name) with transformers' KV cache."""

    def __init__(self, model: MultiLoraModel):
        self.model = model
        self.default_stops = tuple(stop_token_ids(model.tokenizer))

    @torch.no_grad()
    def sample(
        self,
        jobs: Sequence[SampleJob],
        join: Callable[[int], Sequence[SampleJob]] | None = None,
        done: Callable[[int, SampleResult], None] | None = None,
    ) -> list[SampleResult]:
        """Every job's result, in order (joined jobs after ``jobs``). ``join(live_rows)``, called between decode
        steps, returns more jobs to enter the running batch (continuous batching: a request that arrives while a
        batch decodes shares its next steps instead of waiting for its end); ``done(index, result)`` is called as
        soon as that job's rows have all stopped."""
        jobs = list(jobs)
        for job in jobs:
            check_job(job, self.model.vocab_size, self.model.max_context)
        results: list[SampleResult] = []
        live = self._admit(jobs, results)
        left = [job.num_samples for job in jobs]
        joinable = join is not None and _mergeable(live.cache)
        while live.rows:
            logp = torch.log_softmax(live.logits.float(), dim=-1)
            drawn = _draw(live.logits, [jobs[j].spec for j, _ in live.rows], live.generators)
            tokens, keep = [], []
            for r, (j, i) in enumerate(live.rows):
                job, completion = jobs[j], results[j].completions[i]
                token = drawn[r]
                completion.tokens.append(token)
                completion.logprobs.append(float(logp[r, token]))
                if job.topk_sample:
                    top = torch.topk(logp[r], job.topk_sample)
                    completion.topk.append((top.indices.tolist(), top.values.tolist()))
                if self._stopped(job, completion):
                    completion.stop_reason = "stop"
                elif len(completion.tokens) < job.spec.max_tokens:
                    keep.append(r)
                    tokens.append(token)
                    continue
                left[j] -= 1
                if not left[j] and done is not None:
                    done(j, results[j])
            if keep:
                live.select(keep, self.model.device)
                live.step(self, tokens)
            arrived = list(join(len(keep))) if joinable else []
            if arrived:
                for job in arrived:
                    check_job(job, self.model.vocab_size, self.model.max_context)
                first = len(jobs)
                jobs += arrived
                left += [job.num_samples for job in arrived]
                entering = self._admit(arrived, results, first)
                live = live.merge(entering) if keep else entering
            elif not keep:
                break
        return results

    def _admit(self, jobs: Sequence[SampleJob], results: list[SampleResult], first: int = 0) -> _Rows:
        """Prefill ``jobs`` (numbered from ``first``) and repeat each prompt's cache for its ``num_samples`` rows."""
        results += [SampleResult([Completion() for _ in range(job.num_samples)]) for job in jobs]
        logits, cache, attention = self._prefill(jobs, results[first:])
        rows = [(first + j, i) for j, job in enumerate(jobs) for i in range(job.num_samples)]
        index = torch.tensor([j - first for j, _ in rows], device=self.model.device)
        cache.reorder_cache(index)
        generators = [_generator(jobs[j - first].spec.seed, i) for j, i in rows]
        return _Rows(
            rows, generators, cache, attention[index], logits[index], [jobs[j - first].adapter for j, _ in rows]
        )

    def _prefill(
        self, jobs: Sequence[SampleJob], results: list[SampleResult]
    ) -> tuple[torch.Tensor, object, torch.Tensor]:
        """One forward over the left-padded prompts: next-token logits per job, the cache, the attention mask; fills
        the prompt logprobs of the jobs that asked."""
        pad = self.model.tokenizer.pad_token_id or 0
        width = max(len(job.prompt) for job in jobs)
        ids = torch.tensor([[pad] * (width - len(j.prompt)) + list(j.prompt) for j in jobs], device=self.model.device)
        attention = torch.tensor(
            [[0] * (width - len(j.prompt)) + [1] * len(j.prompt) for j in jobs], device=self.model.device
        )
        scored = any(job.prompt_logprobs or job.topk_prompt for job in jobs)
        out = self._forward(
            [job.adapter for job in jobs],
            input_ids=ids,
            attention_mask=attention,
            position_ids=(attention.cumsum(dim=1) - 1).clamp(min=0),
            use_cache=True,
            logits_to_keep=0 if scored else 1,
        )
        for j, job in enumerate(jobs):
            if job.prompt_logprobs or job.topk_prompt:
                n = len(job.prompt)
                logp = torch.log_softmax(out.logits[j, width - n : width - 1].float(), dim=-1)
                results[j].prompt_logprobs = _prompt_logprobs(logp, job.prompt)
                if job.topk_prompt:
                    results[j].prompt_topk = _prompt_topk(logp, job.topk_prompt)
        return out.logits[:, -1], out.cache, attention

    def _forward(self, names: Sequence[str | None], **inputs) -> Any:
        """One forward, each row through its adapter: one adapter for the whole batch when they all share it, else
        peft's mixed batch (``adapter_names``; ``"__base__"`` for the bare model)."""
        unknown = [n for n in names if n is not None and n not in self.model.shapes]
        if unknown:
            raise SamplingError(f"no adapter {unknown[0]!r} is loaded")
        if len(set(names)) == 1:
            with self.model.using(names[0]):
                return self.model.model(**inputs)
        return self.model.model(**inputs, adapter_names=[name or BASE for name in names])

    def _stopped(self, job: SampleJob, completion: Completion) -> bool:
        last = completion.tokens[-1]
        if last in job.spec.stop_tokens or (job.spec.stop_at_eos and last in self.default_stops):
            return True
        if job.spec.stop_strings:
            text = self.model.tokenizer.decode(completion.tokens, skip_special_tokens=False)
            return any(s in text for s in job.spec.stop_strings)
        return False


@dataclass
class _Rows:
    """The decoding rows of a batch: (job, sample) per row, its generator and adapter, and their shared KV cache,
    attention mask (left-padded) and next-token logits."""

    rows: list[tuple[int, int]]
    generators: list[torch.Generator]
    cache: Any
    attention: torch.Tensor
    logits: torch.Tensor
    adapters: list[str | None]

    def select(self, keep: list[int], device: torch.device) -> None:
        """Keep only rows ``keep`` (the others stopped)."""
        if len(keep) == len(self.rows):
            return
        selected = torch.tensor(keep, device=device)
        self.cache.reorder_cache(selected)
        self.attention = self.attention[selected]
        self.rows = [self.rows[r] for r in keep]
        self.generators = [self.generators[r] for r in keep]
        self.adapters = [self.adapters[r] for r in keep]

    def step(self, sampler: HFSampler, tokens: list[int]) -> None:
        """Feed each row its drawn token: the next logits."""
        self.attention = torch.cat([self.attention, self.attention.new_ones((len(self.rows), 1))], dim=1)
        out = sampler._forward(
            self.adapters,
            input_ids=torch.tensor(tokens, device=self.attention.device).unsqueeze(1),
            attention_mask=self.attention,
            position_ids=self.attention.sum(dim=1, keepdim=True) - 1,
            cache=self.cache,
            use_cache=True,
        )
        self.logits, self.cache = out.logits[:, -1], out.cache

    def merge(self, other: _Rows) -> _Rows:
        """These rows and ``other``'s in one batch: the shorter cache and mask left-padded to the longer (masked
        positions, so each row attends to what it did alone)."""
        width = max(self.attention.shape[1], other.attention.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([_pad_left(mine.keys, width, 2), _pad_left(theirs.keys, width, 2)])
            mine.values = torch.cat([_pad_left(mine.values, width, 2), _pad_left(theirs.values, width, 2)])
        self.attention = torch.cat([_pad_left(self.attention, width, 1), _pad_left(other.attention, width, 1)])
        self.logits = torch.cat([self.logits, other.logits])
        self.rows += other.rows
        self.generators += other.generators
        self.adapters += other.adapters
        return self


def _mergeable(cache: Any) -> bool:
    """Whether rows can join this cache: transformers' plain dynamic layers (a sliding window's cannot)."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _pad_left(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if not missing:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _generator(seed: int | None, index: int) -> torch.Generator:
    """Row ``index``'s own random stream: from (seed, index) when seeded, else fresh entropy."""
    if seed is None:
        seed = int(np.random.SeedSequence().generate_state(1, np.uint64)[0] >> np.uint64(1))
    return torch.Generator().manual_seed(sample_seed(seed, index))


def _draw(logits: torch.Tensor, specs: Sequence[SamplingSpec], generators: Sequence[torch.Generator]) -> list[int]:
    """One token per row: greedy at temperature 0, else from softmax(logits / T) cut to the row's top-k and top-p
    mass, by inverting the row's CDF at one uniform draw from the row's own generator (so a row's tokens do not
    depend on the other rows of the batch)."""
    scaled = logits.float().cpu()
    temperature = torch.tensor([s.temperature if s.temperature > 0 else 1.0 for s in specs]).unsqueeze(1)
    scaled = scaled / temperature
    vocab = scaled.shape[1]
    ks = torch.tensor([s.top_k if 0 < s.top_k < vocab else vocab for s in specs])
    if (ks < vocab).any():
        top = torch.topk(scaled, int(ks.max()), dim=-1).values
        kth = top.gather(1, (ks - 1).clamp(max=top.shape[1] - 1).unsqueeze(1))
        scaled = scaled.masked_fill((scaled < kth) & (ks < vocab).unsqueeze(1), -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    top_p = torch.tensor([s.top_p for s in specs])
    if (top_p < 1).any():
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p.unsqueeze(1)
        probs = probs.scatter(1, order, sorted_probs.masked_fill(outside, 0.0))
    cdf = probs.cumsum(-1)
    uniform = torch.tensor([float(torch.rand(1, generator=g)) for g in generators]).unsqueeze(1)
    drawn = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).clamp(max=vocab - 1).squeeze(1)
    greedy = torch.argmax(logits.float().cpu(), dim=-1)
    return [int(greedy[r] if s.temperature == 0 else drawn[r]) for r, s in enumerate(specs)]


def _prompt_logprobs(logp: torch.Tensor, prompt: Sequence[int]) -> np.ndarray:
    targets = torch.as_tensor(list(prompt[1:]), device=logp.device)
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).cpu().numpy()
    return np.concatenate([[np.nan], picked]).astype(np.float32)


def _prompt_topk(logp: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    top = torch.topk(logp, k, dim=-1)
    ids = np.concatenate([np.zeros((1, k), np.int32), top.indices.cpu().numpy().astype(np.int32)])
    values = np.concatenate([np.full((1, k), -99999.0, np.float32), top.values.cpu().numpy().astype(np.float32)])
    return ids, values
