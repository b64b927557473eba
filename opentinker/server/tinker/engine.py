"""The worker: one thread runs every model operation, first come first served, and batches sampling and training.

Why one thread: a base model's LoRA adapters share one set of weights and one peft wrapper whose active adapter is
global state; torch releases the GIL inside its kernels, so the event loop keeps answering while it works; and one
runner per device is how a GPU is used best anyway. Training requests of one model reach the queue already in
sequence order (``sessions.Sequencer``). When a sampling request reaches the head of the queue, every queued
sampling request on the same base model joins its batch (up to ``max_rows`` completions): they share the decode steps;
and while it decodes, sampling requests that reach the head of the queue join it between two steps (continuous
batching), so a request sent a few milliseconds after another's does not wait for its whole pass. When a
``forward_backward`` reaches it, the queued ``forward_backward`` of other clients on the same base model join it (up
to ``max_train_parts``), each client's first queued request only and only when nothing of that client is queued
before it, so every model's requests still run in its sequence order: their rows share the decoder passes
(``adapter_trainer.forward_backward_many``) and each adapter gets the gradient it would get alone. A training pass
cannot be joined once it runs, so it first waits a moment (bounded) for the clients that trained on the same model
recently (``_gather``).

A sampling pass may be long (one tenant's request for hundreds of tokens per row): once it has held the worker for
``SLICE_S`` while other work waits, the waiting work (training, saves, adapter loads; not other sampling requests,
which join the pass) runs between two of its decode steps, for up to as long again, then the pass goes on: no
sampling request holds the worker from the others for more than ``SLICE_S`` plus one decode step. A training pass is
not split (one ``forward_backward`` is one pass).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from opentinker.agents.adapter_trainer import ForwardResult, Part, forward_backward_many
from opentinker.agents.lm_sampler import HFSampler, SampleJob, Sampler, SamplingError, check_job
from opentinker.agents.multi_lora import MultiLoraModel

from .futures import Future, FutureStore, Outcome

log = logging.getLogger(__name__)
ACTIVE_S = 60.0
"""A client that trained on a base model this recently is expected to train again (``TinkerEngine._gather``)."""
SLICE_S = 0.5
"""The longest a sampling pass holds the worker while other work waits (plus one decode step): then the waiting work
runs, for as long again at most, between two of its decode steps (``TinkerEngine._interleave``)."""


@dataclass(eq=False)
class TrainPart:
    """A ``forward_backward`` (or ``forward``) that may share its passes with other clients' on the same base."""

    prepare: Callable[[], Part]
    """On the worker: the checked request (raises when it cannot run: ``TinkerEngine.fail`` makes that its outcome)."""
    finish: Callable[[ForwardResult, float], Outcome]
    """Its result as an ``Outcome`` (given the pass's seconds, for tracking)."""
    forward_only: bool = False


@dataclass(eq=False)
class Work:
    """One request for the worker: an operation (``run``), a sampling ``job`` or a ``train`` part on ``base``'s
    model."""

    future: Future
    run: Callable[[], Outcome] | None = None
    train: TrainPart | None = None
    job: SampleJob | None = None
    base: str = ""
    encode: Callable[[Any], Outcome] | None = None
    """For a sampling job: its result as an ``Outcome``."""
    after: Callable[[Any, float], None] | None = None
    """For a sampling job: called on the worker with its result and the batch's seconds (tracking)."""


@dataclass(eq=False)
class _Call:
    """A management operation (load or drop an adapter) run on the worker, awaited by its caller."""

    fn: Callable[[], Any]
    result: concurrent.futures.Future
    interleave: bool = False
    """Whether it may run between two decode steps of a sampling pass (it adds, never drops, adapters)."""


class TinkerEngine:
    """The queue and its thread; ``model(base)`` (worker thread only) loads a base model on first use."""

    def __init__(
        self,
        futures: FutureStore,
        loader: Callable[[str], MultiLoraModel],
        max_rows: int = 64,
        sampler: Callable[[MultiLoraModel], Sampler] = HFSampler,
        fail: Callable[[Exception], Outcome] | None = None,
        max_train_parts: int = 8,
        gather_s: float = 0.25,
        gather_share: float = 0.1,
        slice_s: float = SLICE_S,
    ):
        """``sampler``: what samples a base model's requests (the seam for another engine, e.g. vLLM on a GPU);
        ``fail``: the outcome of a request whose preparation raised (default: a server error); ``gather_s`` and
        ``gather_share``: the longest a ``forward_backward`` waits for other active clients' (``_gather``), in
        seconds and as a share of the base model's last pass."""
        self.futures, self.loader, self.max_rows, self.make_sampler = futures, loader, max_rows, sampler
        self.fail = fail or _internal_error
        self.max_train_parts, self.gather_s, self.gather_share = max_train_parts, gather_s, gather_share
        self.slice_s = slice_s
        self.interleaved = 0
        """Requests run within a sampling pass, between its decode steps (``_interleave``)."""
        self._trained: dict[str, dict[str, float]] = {}
        """Per base model: each client (model) that trained on it, and when its last pass ended."""
        self._pass_s: dict[str, float] = {}
        self.train_passes = self.train_requests = 0
        """``forward_backward`` batches run and the requests they held (requests / passes: the batching)."""
        self._models: dict[str, MultiLoraModel] = {}
        self._samplers: dict[str, Sampler] = {}
        self._queue: deque[Work | _Call] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self.busy: Future | None = None
        self._thread = threading.Thread(target=self._loop, name="tinker-engine", daemon=True)
        self._thread.start()

    # -- any thread ------------------------------------------------------------------------------------------------
    def submit(self, work: Work) -> None:
        with self._wake:
            self._queue.append(work)
            self._wake.notify()

    def call(self, fn: Callable[[], Any], interleave: bool = False) -> concurrent.futures.Future:
        """Run ``fn`` on the worker (after what is queued); await ``asyncio.wrap_future`` of the result.
        ``interleave``: ``fn`` only adds adapters, so it may run within a long sampling pass (``_interleave``)."""
        item = _Call(fn, concurrent.futures.Future(), interleave)
        with self._wake:
            self._queue.append(item)
            self._wake.notify()
        return item.result

    def queue_state(self, future: Future) -> tuple[str, str | None]:
        """Tinker's queue state of a pending request: ``paused_capacity`` while other clients' work is ahead of it."""
        with self._wake:
            items = list(self._queue)
        ahead = []
        for item in items:
            if isinstance(item, Work) and item.future is future:
                break
            ahead.append(item)
        others = sum(1 for item in ahead if not isinstance(item, Work) or item.future.session != future.session)
        if self.busy is not None and self.busy.session != future.session:
            others += 1
        if future.started is None and others:
            return (
                "paused_capacity",
                f"the shared model is busy: {others} requests of other clients are ahead of this one",
            )
        return "active", None

    def depth(self) -> int:
        with self._wake:
            return len(self._queue) + (self.busy is not None)

    def close(self, timeout: float = 30.0) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout)

    # -- worker thread ---------------------------------------------------------------------------------------------
    def model(self, base: str) -> MultiLoraModel:
        if base not in self._models:
            log.info("loading base model %s", base)
            self._models[base] = self.loader(base)
        return self._models[base]

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                head = self._queue.popleft()
                if isinstance(head, Work) and head.future.outcome is not None:
                    continue  # failed while it waited (its session closed)
                batch = self._take(head)
            self._run(head, batch)
            self.busy = None

    def _take(self, head: Work | _Call) -> list:
        """What runs with ``head``: the sampling or training requests that share its pass (lock held)."""
        if isinstance(head, Work) and head.job is not None:
            return self._take_batch(head)
        if isinstance(head, Work) and head.train is not None:
            self._gather(head)
            return self._take_train_batch(head)
        return [head]

    def _run(self, head: Work | _Call, batch: list) -> None:
        if isinstance(head, _Call):
            self._run_call(head)
        elif head.job is not None:
            self._run_samples(batch)
        elif head.train is not None:
            self._run_train(batch)
        else:
            self._run_work(head)

    def _interleave(self) -> None:
        """Between two decode steps of a sampling pass that has held the worker ``slice_s``: the work waiting behind
        it, in queue order, for up to ``slice_s`` more (at least one item). Not sampling requests (they join the
        pass, or wait for its end: a pass does not nest), nor management calls that may drop an adapter the pass
        reads (they run after it; nothing queued depends on them: what they free is no longer referenced)."""
        deadline = time.monotonic() + self.slice_s
        while not self._closed:
            with self._wake:
                head = next((item for item in self._queue if _between_steps(item)), None)
                if head is None:
                    return
                self._queue.remove(head)
                if isinstance(head, Work) and head.future.outcome is not None:
                    continue
                batch = self._take(head)
            with torch.enable_grad():  # the sampler decodes under no_grad; a training pass needs its graph
                self._run(head, batch)
            self.interleaved += len(batch)
            if time.monotonic() >= deadline:
                return

    def _take_batch(self, head: Work) -> list[Work]:
        """``head`` and the queued sampling requests on its base model that fit ``max_rows`` (lock held)."""
        batch, rows = [head], head.job.num_samples
        for item in list(self._queue):
            if (
                isinstance(item, Work)
                and item.job is not None
                and item.base == head.base
                and item.future.outcome is None
            ):
                if rows + item.job.num_samples > self.max_rows:
                    break
                batch.append(item)
                rows += item.job.num_samples
                self._queue.remove(item)
        return batch

    def _gather(self, head: Work) -> None:
        """Before ``head``'s pass, wait (lock released) for the ``forward_backward`` of the other clients that trained
        on its base model in the last ``ACTIVE_S``: clients sending together reach the queue some milliseconds
        apart, and one that just missed a pass would wait all of it. The wait ends when each of them has one
        queued, or after ``gather_share`` of the last pass (at most ``gather_s``); a client that did not come is no
        longer waited for until it trains again, so one that stopped costs its peers one wait."""
        if head.train.forward_only:  # clients train with forward_backward: they are not waited for with a forward
            return
        self.busy = head.future
        trained = self._trained.setdefault(head.base, {})
        now = time.monotonic()
        expected = {o for o, t in trained.items() if o != head.future.owner and now - t <= ACTIVE_S}
        deadline = now + min(self.gather_s, self.gather_share * self._pass_s.get(head.base, 0.0))

        def missing() -> set[str]:
            queued = {
                item.future.owner
                for item in self._queue
                if isinstance(item, Work) and item.train is not None and item.base == head.base
            }
            return expected - queued

        while missing() and not self._closed and (left := deadline - time.monotonic()) > 0:
            self._wake.wait(left)
        for owner in missing():
            del trained[owner]

    def _take_train_batch(self, head: Work) -> list[Work]:
        """``head`` and, of each other client with a ``forward_backward`` of the same kind queued on the same base
        model, that request, when it is the client's first queued one (lock held). Scanning stops at a management
        call (it may add or drop the adapters a batch would use)."""
        batch, owners, passed = [head], {head.future.owner}, set()
        for item in list(self._queue):
            if len(batch) >= self.max_train_parts or isinstance(item, _Call):
                break
            owner = item.future.owner
            joins = (
                item.train is not None
                and item.base == head.base
                and item.train.forward_only == head.train.forward_only
                and item.future.outcome is None
                and owner not in owners
                and owner not in passed
            )
            if joins:
                batch.append(item)
                owners.add(owner)
                self._queue.remove(item)
            else:
                passed.add(owner)  # its later requests wait for this one
        return batch

    def _run_train(self, batch: list[Work]) -> None:
        started = time.perf_counter()
        prepared: list[tuple[Work, Part]] = []
        for work in batch:
            self._start(work)
            try:
                prepared.append((work, work.train.prepare()))
            except Exception as error:
                self._finish(work, self.fail(error))
        if not prepared:
            return
        self.train_passes += 1
        self.train_requests += len(prepared)
        try:
            results = forward_backward_many([part for _, part in prepared], batch[0].train.forward_only)
        except Exception as error:
            log.exception("forward_backward of %d clients failed", len(prepared))
            for work, _ in prepared:
                self._finish(work, _internal_error(error))
            return
        seconds = time.perf_counter() - started
        if not batch[0].train.forward_only:  # what _gather waits for, and how long
            base = batch[0].base
            self._pass_s[base] = seconds
            self._trained.setdefault(base, {}).update((work.future.owner, time.monotonic()) for work, _ in prepared)
        for (work, _), result in zip(prepared, results):
            try:
                outcome = work.train.finish(result, seconds)
            except Exception as error:
                outcome = self.fail(error)
            self._finish(work, outcome)

    def _run_call(self, item: _Call) -> None:
        try:
            item.result.set_result(item.fn())
        except BaseException as error:  # handed to the awaiting caller
            item.result.set_exception(error)

    def _run_work(self, work: Work) -> None:
        self._start(work)
        try:
            outcome = work.run()
        except Exception as error:
            log.exception("tinker request %s failed", work.future.request_id)
            outcome = _internal_error(error)
        self._finish(work, outcome)

    def _run_samples(self, batch: list[Work]) -> None:
        """One sampling pass: ``batch`` and the requests that join it between its decode steps (``_join``), each
        resolved as soon as its rows have stopped."""
        for work in batch:
            self._start(work)
        base = batch[0].base
        try:
            model = self.model(base)
        except Exception as error:
            log.exception("loading %s failed", base)
            for work in batch:
                self._finish(work, Outcome.failed(f"internal error loading the model: {error}", "server"))
            return
        running = self._checked(batch, model)
        if not running:
            return
        started = {id(work): time.perf_counter() for work in running}
        open_works = dict(enumerate(running))
        slice_started = time.monotonic()

        def join(live_rows: int) -> list[SampleJob]:
            nonlocal slice_started
            if time.monotonic() - slice_started >= self.slice_s:  # the pass has had its slice: others' turn
                self._interleave()
                self.busy, slice_started = running[0].future, time.monotonic()
            joined = self._checked(self._join(base, live_rows), model)
            for work in joined:
                started[id(work)] = time.perf_counter()
                open_works[len(running)] = work
                running.append(work)
            return [work.job for work in joined]

        def done(index: int, result: Any) -> None:
            work = open_works.pop(index)
            self._finish(work, work.encode(result))
            if work.after is not None:
                try:
                    work.after(result, time.perf_counter() - started[id(work)])
                except Exception:
                    log.exception("tracking hook failed for %s", work.future.request_id)

        try:
            if model.base not in self._samplers:
                self._samplers[model.base] = self.make_sampler(model)
            self._samplers[model.base].sample([work.job for work in running], join=join, done=done)
        except Exception as error:
            log.exception("sampling batch failed")
            for work in open_works.values():
                self._finish(work, Outcome.failed(f"internal error: {type(error).__name__}: {error}", "server"))

    def _join(self, base: str, live_rows: int) -> list[Work]:
        """The sampling requests on ``base`` at the head of the queue that fit beside ``live_rows`` running rows:
        they join the running pass. Only from the head, so a request of another kind (or a management call) queued
        first ends the joining and the pass drains: nothing waits behind a pass that keeps growing."""
        joined, rows = [], live_rows
        with self._wake:
            while self._queue:
                item = self._queue[0]
                if not (isinstance(item, Work) and item.job is not None and item.base == base):
                    break
                if item.future.outcome is None:
                    if rows + item.job.num_samples > self.max_rows:
                        break
                    rows += item.job.num_samples
                    joined.append(item)
                self._queue.popleft()
        for work in joined:
            self._start(work)
        return joined

    def _checked(self, works: list[Work], model: MultiLoraModel) -> list[Work]:
        """The works whose job the model can run; the others fail, naming why."""
        runnable = []
        for work in works:
            try:
                check_job(work.job, model.vocab_size, model.max_context)
                runnable.append(work)
            except SamplingError as error:
                self._finish(work, Outcome.failed(str(error)))
        return runnable

    def _start(self, work: Work) -> None:
        self.busy = work.future
        self.futures.mark_started(work.future)

    def _finish(self, work: Work, outcome: Outcome) -> None:
        self.futures.resolve(work.future, outcome)


def _internal_error(error: Exception) -> Outcome:
    return Outcome.failed(f"internal error: {type(error).__name__}: {error}", "server")


def _between_steps(item: Work | _Call) -> bool:
    """Whether a queued item may run between two decode steps of a sampling pass (``TinkerEngine._interleave``)."""
    return item.interleave if isinstance(item, _Call) else item.job is None
