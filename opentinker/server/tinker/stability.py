"""``record_stability_info`` and the ``stable_reinforce`` loss it serves.

A sampling request with ``record_stability_info`` has the server keep, per sampled sequence (its ``sequence_id``, one
per sample, handed out when the request is submitted), the prompt, the sampled tokens and the logprob the sampler
gave each token. A training datum names that record through its provenance (``Datum.with_provenance``: runs of
``SampledProvenanceSpan`` and ``PromptProvenanceSpan`` tiling its tokens). For ``stable_reinforce`` the server checks
every run against the record (the datum's tokens are the recorded ones) and fills the datum's ``logprobs`` with the
recorded sampler logprobs, zeroing the advantage of every position the sampler did not produce; the loss is then the
clipped-ratio one (``agents.token_losses``): the ratio is always against what the sampler really computed, whatever
the client kept, re-tokenised or recomputed.

Tinker has not published ``stable_reinforce``'s objective; this is OpenTinker's reading of its contract (records per
session, named by ``sequence_id``, kept a day from their last use), not a copy of its maths.

Records belong to the session that sampled them (a datum of another session's sequence is not found), live in the
server process with the session, and go when it ends, or a day after their last use.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from opentinker.agents.adapter_trainer import TokenDatum
from opentinker.agents.token_losses import LossInputError

KEEP_S = 86400.0
"""A record is kept this long after its sampling or its last use in a training request (Tinker's "one day")."""
MAX_RECORDS = 65536
"""Sequences recorded per session; past it the least recently used go first."""


@dataclass(frozen=True)
class Span:
    """One provenance run: ``length`` positions that are positions ``offset...`` of ``sequence_id``'s sampled
    tokens (``sampled``) or of its request's prompt."""

    sampled: bool
    sequence_id: str
    offset: int
    length: int


@dataclass(frozen=True)
class Provenance:
    """A datum's provenance: runs tiling its model input and runs tiling its ``target_tokens``."""

    model_input: tuple[Span, ...]
    loss_fn_inputs: tuple[Span, ...]


@dataclass
class _Record:
    prompt: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    used: float


class StabilityLog:
    """One session's recorded sequences (thread-safe: recorded and read on the worker, expired by the reaper)."""

    def __init__(self, keep_s: float = KEEP_S, max_records: int = MAX_RECORDS):
        self.keep_s, self.max_records = keep_s, max_records
        self._records: OrderedDict[str, _Record] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    def record(self, sequence_ids: Sequence[str], prompt: Sequence[int], completions: Sequence) -> None:
        """Keep each completion (``tokens``, ``logprobs``) under its sequence id, with the request's prompt."""
        shared = np.asarray(prompt, dtype=np.int64)
        now = time.monotonic()
        with self._lock:
            for sequence_id, completion in zip(sequence_ids, completions, strict=True):
                tokens = np.asarray(completion.tokens, dtype=np.int64)
                logprobs = np.asarray(completion.logprobs, dtype=np.float32)
                self._records[sequence_id] = _Record(shared, tokens, logprobs, now)
                self._records.move_to_end(sequence_id)
            while len(self._records) > self.max_records:
                self._records.popitem(last=False)

    def get(self, sequence_id: str) -> _Record | None:
        """The record (its day restarts), or None if this session never recorded it or it expired."""
        now = time.monotonic()
        with self._lock:
            record = self._records.get(sequence_id)
            if record is None or now - record.used > self.keep_s:
                return None
            record.used = now
            self._records.move_to_end(sequence_id)
            return record

    def clear(self) -> None:
        with self._lock:
            self._records.clear()

    def expire(self) -> int:
        """Forget records unused for ``keep_s``; how many went."""
        horizon = time.monotonic() - self.keep_s
        with self._lock:
            stale = [key for key, record in self._records.items() if record.used < horizon]
            for key in stale:
                del self._records[key]
        return len(stale)


def resolve(data: Sequence[TokenDatum], provenance: Sequence[Provenance | None], log: StabilityLog) -> list[TokenDatum]:
    """``stable_reinforce``'s datums: each one's provenance checked against the session's records, its
    ``logprobs`` the recorded sampler logprobs, its advantages zero where the sampler produced no token."""
    resolved = []
    for index, (datum, spans) in enumerate(zip(data, provenance, strict=True)):
        where = f"data[{index}]"
        if spans is None:
            raise LossInputError(
                f"{where}: stable_reinforce needs the datum's provenance: sample with record_stability_info=True and "
                "attach the sequence ids with Datum.with_provenance(...)"
            )
        targets = datum.inputs.get("target_tokens")
        if targets is None or targets.ndim != 1:
            raise LossInputError(
                f"{where}.loss_fn_inputs['target_tokens']: stable_reinforce needs one target per position"
            )
        _check(f"{where}.model_input_spans", np.asarray(datum.tokens, dtype=np.int64), spans.model_input, log)
        logprobs, sampled = _check(f"{where}.loss_fn_input_spans", targets.astype(np.int64), spans.loss_fn_inputs, log)
        inputs = dict(datum.inputs)
        inputs["logprobs"] = logprobs
        advantages = inputs.get("advantages")
        if advantages is not None and advantages.shape == sampled.shape:
            inputs["advantages"] = np.where(sampled, advantages, 0.0).astype(np.float32)
        resolved.append(TokenDatum(datum.tokens, inputs))
    return resolved


def _check(where: str, tokens: np.ndarray, spans: Sequence[Span], log: StabilityLog) -> tuple[np.ndarray, np.ndarray]:
    """Check that ``spans`` tile ``tokens`` and that each run is what its record holds; (the recorded logprobs at
    sampled positions, 0 elsewhere; which positions were sampled)."""
    total = sum(span.length for span in spans)
    if total != len(tokens):
        raise LossInputError(f"{where}: the runs cover {total} positions, the field has {len(tokens)}")
    logprobs = np.zeros(len(tokens), dtype=np.float32)
    sampled = np.zeros(len(tokens), dtype=bool)
    position = 0
    for number, span in enumerate(spans):
        record = log.get(span.sequence_id)
        if record is None:
            raise LossInputError(
                f"{where}[{number}]: sequence {span.sequence_id!r} was not sampled with record_stability_info in "
                "this session (or its record expired)"
            )
        source = record.tokens if span.sampled else record.prompt
        part = "sampled tokens" if span.sampled else "prompt"
        stop = span.offset + span.length
        if span.offset < 0 or span.length < 0 or stop > len(source):
            raise LossInputError(
                f"{where}[{number}]: positions {span.offset}..{stop} are outside sequence {span.sequence_id!r}'s "
                f"{part} ({len(source)} tokens)"
            )
        here = slice(position, position + span.length)
        if not np.array_equal(tokens[here], source[span.offset : stop]):
            raise LossInputError(
                f"{where}[{number}]: tokens {here.start}..{here.stop} are not positions {span.offset}..{stop} of "
                f"sequence {span.sequence_id!r}'s {part}"
            )
        if span.sampled:
            logprobs[here] = record.logprobs[span.offset : stop]
            sampled[here] = True
        position += span.length
    return logprobs, sampled
