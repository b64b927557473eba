"""bench/tinker_api.py's server, and its parts ``clients`` (concurrent SDK clients of different tenants on one server),
``fairness`` (one tenant's short calls while another's long sampling saturates the engine) and ``restart`` (an SDK
client's loop across an API killed with SIGKILL and started again); bench/tinker_api.py's docstring says what each
figure means."""

from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time
from pathlib import Path

import numpy as np

PROMPT = "Question: Tom has 17 apples and buys 25 more. How many apples does he have now? Answer:"
KINDS = ("save_weights_for_sampler", "sample", "forward_backward", "optim_step")
FB_SCALING_FLOOR, SAMPLE_SCALING_FLOOR, SHARE_SPREAD_CEILING = 1.2, 2.0, 0.25
FAIRNESS_CEILING = 2.0
"""A tenant's p99 beside a saturating tenant, at most this many times its p99 alone."""


class Server:
    """``opentinker server up --no-jobs`` with the Tinker API on ``base`` and the tiny model, started by the bench;
    keys of any tenant, and a SIGKILL of the API's process group and a start again on the same data dir and port (as
    tests/fixtures/server.py does)."""

    def __init__(self, root: Path, base: str, cache_dir: str, threads: int | None):
        from opentinker.server.launcher import start_server

        self.root = root
        self.env = {
            **os.environ,
            "OPENTINKER_DATA_DIR": str(root / "data"),
            "OPENTINKER_TINKER_BASE_MODELS": json.dumps([base, "tiny"]),
            "OPENTINKER_TINKER_CACHE_DIR": cache_dir,
            # heartbeats do not reach the engine while the API is down: no reaping of a client across a slow restart
            "OPENTINKER_TINKER_SESSION_TIMEOUT_S": "600",
        }
        if threads:
            self.env["OPENTINKER_TINKER_THREADS"] = str(threads)
        self.log = root / "server.log"
        self.service = start_server(self.log, jobs=False, env=self.env)
        self.url = self.service.url

    def key(self, tenant: str) -> str:
        """A new key of ``tenant`` (made if new) with the ``tinker`` scope, written to the server's database."""
        from opentinker.server.db import Store
        from opentinker.server.keys import KeyRing

        store = Store(f"sqlite:///{self.root / 'data' / 'server' / 'server.db'}")
        try:
            return KeyRing(store).create(tenant, ("tinker",))[1]
        finally:
            store.close()

    def kill_and_restart(self) -> float:
        """SIGKILL the API's process group (the engine, a detached Ray actor on a Ray head of its own process group,
        lives on), reap it, start it again on the same port and data dir; seconds until it answers again."""
        from opentinker.server.launcher import start_server

        started = time.perf_counter()
        os.killpg(self.service.pid, signal.SIGKILL)
        if self.service.exit_code(timeout=30) is None:
            raise RuntimeError("the killed API did not exit within 30 s")
        self.service = start_server(self.log, port=int(self.url.rsplit(":", 1)[1]), jobs=False, env=self.env)
        return time.perf_counter() - started

    def stop(self) -> None:
        """Stop the API normally, then what ``opentinker server down`` stops: the engine's local Ray head (an API
        started again after a kill did not start it, so its own stop leaves it)."""
        from opentinker.infra.settings import Settings
        from opentinker.server.launcher import stop_services

        self.service.stop()
        stop_services(Settings(data_dir=self.root / "data"))


class Loop:
    """One tenant's LoRA training client and its step: save its weights for a sampler, sample a group of
    ``client_group`` completions of one prompt, ``forward_backward`` with ``importance_sampling`` on them (the
    sampler's logprobs, a fixed zero-mean advantage per completion: the bench measures throughput, not learning),
    ``optim_step``. Each future is timed from submit to result (after ``sync``)."""

    def __init__(self, url: str, key: str, base: str, args, seed: int):
        import tinker
        from tinker import types

        self.args, self.seed = args, seed
        self.service = tinker.ServiceClient(base_url=url, api_key=key)
        self.training = self.service.create_lora_training_client(base, rank=16, seed=seed).result()
        self.prompt = self.training.get_tokenizer().encode(PROMPT)
        self.adam = types.AdamParams(learning_rate=1e-4)
        self.steps = 0
        self.sync = lambda: None
        """Called before each future is sent (the part ``clients``: a barrier of all clients)."""
        self.times: dict[str, list[tuple[float, float]]] = {kind: [] for kind in KINDS}
        self.tokens = {"sample": 0, "forward_backward": 0}

    def _timed(self, kind: str, submit):
        self.sync()
        started = time.perf_counter()
        result = submit().result()
        self.times[kind].append((started, time.perf_counter()))
        return result

    def step(self) -> None:
        from tinker import types

        params = types.SamplingParams(
            max_tokens=self.args.client_max_tokens, temperature=1.0, seed=self.seed * 100_000 + self.steps
        )
        prompt = types.ModelInput.from_ints(self.prompt)
        sampler = self._timed("save_weights_for_sampler", self.training.save_weights_and_get_sampling_client)
        sequences = self._timed("sample", lambda: sampler.sample(prompt, self.args.client_group, params)).sequences
        advantages = np.linspace(-1.0, 1.0, len(sequences)) if len(sequences) > 1 else [1.0]
        pad = [0.0] * (len(self.prompt) - 1)
        data = []
        for sequence, advantage in zip(sequences, advantages):
            full = self.prompt + list(sequence.tokens)
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={
                        "target_tokens": np.array(full[1:], dtype=np.int64),
                        "logprobs": np.array(pad + list(sequence.logprobs or []), dtype=np.float32),
                        "advantages": np.array(pad + [float(advantage)] * len(sequence.tokens), dtype=np.float32),
                    },
                )
            )
        self._timed("forward_backward", lambda: self.training.forward_backward(data, "importance_sampling"))
        self._timed("optim_step", lambda: self.training.optim_step(self.adam))
        self.tokens["sample"] += sum(len(s.tokens) for s in sequences)
        self.tokens["forward_backward"] += sum(d.model_input.length for d in data)
        self.steps += 1

    def reset(self) -> None:
        """Forget the figures so far (after a warm-up step)."""
        self.times = {kind: [] for kind in KINDS}
        self.tokens = {"sample": 0, "forward_backward": 0}

    def close(self) -> None:
        self.service.close("success").result()


def percentiles(durations_s: list[float]) -> dict:
    ms = np.array(durations_s) * 1000
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "n": len(ms)}


def run_clients(server: Server, base: str, n: int, args) -> dict:
    """``n`` tenants' loops at once, ``args.client_steps`` steps each after one warm-up step; every future of every
    client is sent together (a barrier), so the same kind of request of every client reaches the server at about the
    same time."""
    loops = [Loop(server.url, server.key(f"clients{n}-{i}"), base, args, seed=i) for i in range(n)]
    barrier, errors = threading.Barrier(n), []

    def drive(loop: Loop) -> None:
        try:
            loop.sync = barrier.wait
            for step in range(args.client_steps + 1):
                loop.step()
                if step == 0:  # the next step's first barrier waits for every client's warm-up
                    loop.reset()
        except Exception as error:  # raised once every thread ended; the other clients are released
            errors.append(repr(error))
            barrier.abort()

    threads = [threading.Thread(target=drive, args=(loop,)) for loop in loops]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for loop in loops:
        loop.close()
    if errors:
        raise RuntimeError(f"{n} clients: {errors[0]}")
    figures = {}
    for kind in ("forward_backward", "sample"):
        # each step's span of this kind: first client's submit to last client's result
        spans = [max(t[1] for t in ts) - min(t[0] for t in ts) for ts in zip(*(loop.times[kind] for loop in loops))]
        figures[f"{'fb' if kind == 'forward_backward' else kind}_tokens_per_s"] = sum(
            loop.tokens[kind] for loop in loops
        ) / sum(spans)
    rates = [
        sum(loop.tokens.values()) / sum(done - started for ts in loop.times.values() for started, done in ts)
        for loop in loops
    ]
    figures["share_spread"] = max(abs(rate / statistics.fmean(rates) - 1) for rate in rates)
    figures["latency_ms"] = {
        kind: percentiles([done - started for loop in loops for started, done in loop.times[kind]]) for kind in KINDS
    }
    return figures


def clients_part(server: Server, base: str, args) -> dict:
    """Figures ``clients<n>_...`` per client count, and ``clients<n>_fb_scaling`` / ``_sample_scaling`` against one
    client (with their floors for 4 clients)."""
    line = {}
    counts = [int(c) for c in args.clients.split(",")]
    for n in counts:
        figures = run_clients(server, base, n, args)
        print(f"{n} clients:", json.dumps(figures), flush=True)
        line.update({f"clients{n}_{k}": v for k, v in figures.items()})
    for n in counts:
        if n > 1 and 1 in counts:
            for kind in ("fb", "sample"):
                line[f"clients{n}_{kind}_scaling"] = (
                    line[f"clients{n}_{kind}_tokens_per_s"] / line[f"clients1_{kind}_tokens_per_s"]
                )
    if "clients4_fb_scaling" in line:
        line["clients4_ok"] = (
            line["clients4_fb_scaling"] >= FB_SCALING_FLOOR
            and line["clients4_sample_scaling"] >= SAMPLE_SCALING_FLOOR
            and line["clients4_share_spread"] <= SHARE_SPREAD_CEILING
        )
    return line


def fairness_part(server: Server, base: str, args) -> dict:
    """Tenant ``short``'s steps (``Loop``: short sampling, ``forward_backward``, ...) alone, then again while tenant
    ``long`` sends sampling requests of ``args.fairness_long_tokens`` new tokens x ``args.fairness_long_samples``
    back to back (its next sent as its last returns, so the engine always holds one); each kind's p50/p99 both ways
    and the ratio of the p99s."""
    import tinker
    from tinker import types

    short = Loop(server.url, server.key("fairness-short"), base, args, seed=0)
    short.step()  # warm-up: its adapter, the sampler's first load
    short.reset()
    for _ in range(args.fairness_steps):
        short.step()
    alone = {kind: [end - start for start, end in spans] for kind, spans in short.times.items()}
    stop, sent, errors = threading.Event(), [], []
    long_service = tinker.ServiceClient(base_url=server.url, api_key=server.key("fairness-long"))
    long_sampler = long_service.create_sampling_client(base_model=base)
    prompt = types.ModelInput.from_ints(short.prompt)

    def saturate() -> None:
        try:
            while not stop.is_set():
                params = types.SamplingParams(max_tokens=args.fairness_long_tokens, temperature=1.0, seed=len(sent))
                long_sampler.sample(prompt, args.fairness_long_samples, params).result()
                sent.append(time.perf_counter())
        except Exception as error:  # the figure says the saturating tenant failed
            errors.append(repr(error))

    thread = threading.Thread(target=saturate)
    thread.start()
    time.sleep(1.0)  # its first request holds the engine
    short.reset()
    for _ in range(args.fairness_steps):
        short.step()
    stop.set()
    thread.join()
    short.close()
    long_service.close("success").result()
    beside = {kind: [end - start for start, end in spans] for kind, spans in short.times.items()}
    line: dict = {"fairness_long_requests": len(sent), "fairness_error": errors[0] if errors else None}
    for kind in KINDS:
        line[f"fairness_{kind}_alone_ms"] = percentiles(alone[kind])
        line[f"fairness_{kind}_beside_ms"] = percentiles(beside[kind])
        line[f"fairness_{kind}_p99_ratio"] = float(np.percentile(beside[kind], 99) / np.percentile(alone[kind], 99))
    line["fairness_ok"] = not errors and all(
        line[f"fairness_{kind}_p99_ratio"] <= FAIRNESS_CEILING for kind in ("forward_backward", "sample")
    )
    return line


def restart_part(server: Server, base: str, args) -> dict:
    """One client's loop of ``args.restart_steps`` steps; after ``args.restart_after`` of them the API is killed
    with SIGKILL and started again. The stall: the longest gap between two consecutive completed steps minus the
    median gap."""
    loop = Loop(server.url, server.key("restart"), base, args, seed=0)
    done: list[float] = []
    errors: list[str] = []

    def drive() -> None:
        try:
            for _ in range(args.restart_steps):
                loop.step()
                done.append(time.perf_counter())
        except Exception as error:  # the figure says the loop did not go on
            errors.append(repr(error))

    thread = threading.Thread(target=drive)
    thread.start()
    while len(done) < args.restart_after and thread.is_alive():
        time.sleep(0.05)
    down_s = server.kill_and_restart()
    thread.join()
    if not errors:
        loop.close()
    gaps = np.diff(done)
    return {
        "api_restart_pause_s": float(gaps.max() - np.median(gaps)) if len(gaps) else None,
        "api_restart_median_step_s": float(np.median(gaps)) if len(gaps) else None,
        "api_restart_down_s": down_s,
        "api_restart_steps_done": len(done),
        "api_restart_ok": not errors and len(done) == args.restart_steps,
        "api_restart_error": errors[0] if errors else None,
    }
