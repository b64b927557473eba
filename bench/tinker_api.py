"""A GRPO loop written against the official Tinker SDK, through OpenTinker's server, vs the built-in GRPO; 1, 2
and 4 SDK clients of different tenants on one server; an SDK loop across an API killed with SIGKILL and restarted.

    .venv/bin/python bench/tinker_api.py --steps 30 --prompts-per-step 4 --group-size 8 --lr 5e-4 --eval-prompts 32

Both halves train a rank-16 LoRA adapter (alpha 32, attention and MLP projections) on SmolLM2-135M-Instruct for
``arithmetic``'s train split, on the same prompts in the same order (``PromptSampler``), with the same group size,
max new tokens, temperature, learning rate, AdamW settings (betas 0.9/0.999, eps 1e-8, clip 1.0), group-normalised
advantages and token-level REINFORCE (one pass per batch, so PPO's ratio is 1): the SDK loop sends it as
``importance_sampling`` with each token's advantage divided by the step's completion tokens, which is the built-in's
token mean. Episodes are the env's (a ``python_repl`` call allowed, two turns); the SDK loop plays them client-side,
sampling through the server (a group's first turn is one ``num_samples`` request). Held-out success: greedy, the
first ``--eval-prompts`` held-out prompts, before and after. Then p50/p99 latencies of ``forward_backward``,
``optim_step`` and ``sample`` futures (submit to result, one at a time) on the tiny model. Floors: the SDK loop's
completions/s >= 0.8x the built-in's; held-out success after equal within noise (|difference| <= 2 standard errors).
That is the part ``ratio``. A step's cost depends on what the policy learned: a half that learned to call the tool
plays two turns, the second on a longer prompt, in sampling and in the backward (SmolLM2, 30 steps at 5e-4: the SDK
half's steps cost 2x the built-in's after it learned, the built-in not), so the learning run's completions/s ratio
compares different work. The part ``throughput`` compares the same work: both halves for ``--throughput-steps`` at
learning rate 0 (the base policy throughout, every optimiser step still taken); its ratio is the floor's
(``ratio_ok``). Three more run on the same ``opentinker server up`` (``--parts`` picks; default all):

``clients``: 1, 2 and 4 (``--clients``) official-SDK clients at once, each a tenant of its own (its own key) with its
own rank-16 LoRA training client on ``--base``, each running ``--client-steps`` steps (after one warm-up step) of: save
weights for a sampler, sample ``--client-group`` completions of one prompt (``--client-max-tokens``, temperature 1),
``forward_backward`` with ``importance_sampling`` on them, ``optim_step``; the clients send each of these together (a
barrier before each), so their requests of one kind reach the server at about the same time for the engine to batch.
``clients<n>_fb_tokens_per_s`` / ``_sample_tokens_per_s``: every client's ``forward_backward`` input tokens / sampled
tokens over the sum, over steps, of that kind's span (first client's submit to last client's result);
``clients4_fb_scaling`` / ``clients4_sample_scaling``: 4 clients' aggregate over one client's (floors 1.2 and 2);
``clients<n>_share_spread``: each client's tokens (sampled + ``forward_backward``) per second of its own futures'
time, the largest relative distance from the clients' mean (ceiling 0.25 for 4 clients: each client's share within
25 % of equal); ``clients<n>_latency_ms``: p50/p99 submit-to-result of each kind of future over all clients.
``clients4_ok``: the three bounds hold.

``fairness``: one tenant's steps of that loop (``--fairness-steps`` after a warm-up), first alone, then while a
second tenant keeps one sampling request of ``--fairness-long-tokens`` new tokens x ``--fairness-long-samples`` in the
engine at all times. ``fairness_<kind>_alone_ms`` / ``_beside_ms``: p50/p99 of each kind of the first tenant's
futures; ``fairness_<kind>_p99_ratio``: beside over alone; ``fairness_ok``: ``forward_backward`` and ``sample``
within 2x (the engine interleaves waiting work into a long sampling pass every 0.5 s: docs/tinker_api.md).

``restart``: one SDK client runs ``--restart-steps`` steps of that loop; after ``--restart-after`` of them the bench
SIGKILLs the API's process group (the engine, a detached Ray actor, lives on) and starts it again on the same data dir
and port. ``api_restart_pause_s``: the longest gap between two consecutive completed steps minus the median gap (the
time the loop lost); ``api_restart_down_s``: from the kill until the new API answered; ``api_restart_ok``: every step
completed with no error visible to the client.

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

from grpo_common import builtin_grpo, half_figures, point, rerun_command  # bench/ is sys.path[0]
from tinker_clients import Server, clients_part, fairness_part, restart_part

os.environ.setdefault("HF_HUB_OFFLINE", "1")
RATIO_FLOOR = 0.8
PARTS = {"ratio", "throughput", "clients", "fairness", "restart"}


# -- the SDK loop -----------------------------------------------------------------------------------------------------
def play(sampler, tokenizer, envs, indices, group_size: int, max_tokens: int, temperature: float, seed: int):
    """Play ``group_size`` episodes of each prompt index through the sampler, every turn's requests in flight at
    once (the server batches them); returns the episodes and each turn's sampled logprobs."""
    from tinker import types

    from opentinker.agents.lm_rollout import chat_prompt_ids, open_episode, take_turn

    episodes, chats, logprobs = [], [], []
    for g, index in enumerate(indices):
        for _ in range(group_size):
            episode, chat = open_episode(envs[len(episodes)], index, g)
            episodes.append(episode)
            chats.append(chat)
            logprobs.append([])
    active, turn = list(range(len(episodes))), 0
    while active:
        prompts = {i: chat_prompt_ids(tokenizer, chats[i]) for i in active}
        params = types.SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed * 1000 + turn)
        if turn == 0:  # a group shares its first prompt: one request for the whole group
            firsts = [active[k : k + group_size] for k in range(0, len(active), group_size)]
            futures = [
                (rows, sampler.sample(types.ModelInput.from_ints(prompts[rows[0]]), len(rows), params))
                for rows in firsts
            ]
        else:
            futures = [([i], sampler.sample(types.ModelInput.from_ints(prompts[i]), 1, params)) for i in active]
        still = []
        for rows, future in futures:
            for i, sequence in zip(rows, future.result().sequences):
                logprobs[i].append(list(sequence.logprobs or []))
                if take_turn(envs[i], episodes[i], chats[i], tokenizer, prompts[i], sequence.tokens):
                    still.append(i)
        active, turn = sorted(still), turn + 1
    return episodes, logprobs


def grpo_datums(episodes, logprobs, group_size: int):
    """The step's ``importance_sampling`` data: every generated turn of every episode with a non-zero
    group-normalised advantage, each token's advantage divided by the step's completion tokens."""
    import numpy as np
    import torch
    from tinker import types

    from opentinker.agents.grpo import group_advantages

    rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32).view(-1, group_size)
    advantages = group_advantages(rewards, scale=True).flatten().tolist()
    n_tokens = sum(len(t.completion_ids) for e in episodes for t in e.turns)
    data = []
    for episode, advantage, turn_logprobs in zip(episodes, advantages, logprobs):
        if advantage == 0:
            continue
        for turn, sampled in zip(episode.turns, turn_logprobs):
            if not turn.completion_ids:
                continue
            full, pad = turn.prompt_ids + turn.completion_ids, [0.0] * (len(turn.prompt_ids) - 1)
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={
                        "target_tokens": np.array(full[1:], dtype=np.int64),
                        "logprobs": np.array(pad + sampled, dtype=np.float32),
                        "advantages": np.array(pad + [advantage / n_tokens] * len(turn.completion_ids), np.float32),
                    },
                )
            )
    return data


def heldout(sampler, tokenizer, args) -> float:
    from opentinker.envs.text_tasks import make_text_env

    envs = [make_text_env("arithmetic", "heldout", 0) for _ in range(args.eval_prompts)]
    episodes, _ = play(sampler, tokenizer, envs, list(range(args.eval_prompts)), 1, args.max_new_tokens, 0.0, 0)
    return sum(e.success for e in episodes) / len(episodes)


def sdk_run(args, url: str, key: str) -> dict:
    import tinker
    from tinker import types

    from opentinker.agents.grpo_trainer import PromptSampler
    from opentinker.envs.text_tasks import make_text_env, task_examples
    from opentinker.server.tinker.core import DISPLAY_NAMES

    service = tinker.ServiceClient(base_url=url, api_key=key)
    model = DISPLAY_NAMES[args.base]
    try:
        training = service.create_lora_training_client(model, rank=16, seed=args.seed, train_unembed=False).result()
        tokenizer = training.get_tokenizer()
        before = heldout(service.create_sampling_client(base_model=model).result(), tokenizer, args)
        envs = [make_text_env("arithmetic", "train", 0) for _ in range(args.group_size * args.prompts_per_step)]
        prompts = PromptSampler(len(task_examples("arithmetic", "train", 0)), args.seed)
        adam = types.AdamParams(learning_rate=args.lr, beta1=0.9, beta2=0.999, eps=1e-8, grad_clip_norm=1.0)
        curve, seconds, phases = [], 0.0, dict.fromkeys(("save_weights", "sample", "train"), 0.0)
        for step in range(args.steps):
            started = time.perf_counter()
            sampler = training.save_weights_and_get_sampling_client().result()
            saved = time.perf_counter()
            phases["save_weights"] += saved - started
            episodes, logprobs = play(
                sampler,
                tokenizer,
                envs,
                prompts.draw(args.prompts_per_step),
                args.group_size,
                args.max_new_tokens,
                args.temperature,
                args.seed * 100_000 + step,
            )
            sampled = time.perf_counter()
            phases["sample"] += sampled - saved
            data = grpo_datums(episodes, logprobs, args.group_size)
            if data:
                fwd_bwd = training.forward_backward(data, "importance_sampling")
                training.optim_step(adam).result()
                fwd_bwd.result()
            phases["train"] += time.perf_counter() - sampled
            seconds += time.perf_counter() - started
            tokens = sum(len(turn.completion_ids) for episode in episodes for turn in episode.turns)
            point(curve, "sdk", step + 1, sum(e.reward for e in episodes) / len(episodes), seconds, tokens)
        final = training.save_weights_for_sampler("final").result().path
        after = heldout(service.create_sampling_client(model_path=final).result(), tokenizer, args)
    finally:
        service.close("success").result()
    per_step = {f"{name}_s_per_step": total / args.steps for name, total in phases.items()}
    return {**half_figures(args, seconds, curve, after, before), **per_step}


def builtin_run(args) -> dict:
    try:
        return builtin_grpo(args, args.base, args.builtin_backend, "built-in")
    finally:
        if args.builtin_backend == "ray":
            import ray

            ray.shutdown()


# -- latency on the tiny model ----------------------------------------------------------------------------------------
def latencies(args, url: str, key: str) -> dict:
    """Submit-to-result milliseconds of each kind of future, one request at a time, on the tiny model."""
    import numpy as np
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key=key)
    try:
        training = service.create_lora_training_client("opentinker/tiny-llama", rank=8, seed=0).result()
        tokens = list(range(100, 164))
        batch = [
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": np.ones(63, np.float32)},
            )
        ] * 4
        sampler = training.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=16, temperature=1.0)
        calls = {
            "forward_backward": lambda: training.forward_backward(batch, "cross_entropy").result(),
            "optim_step": lambda: training.optim_step(types.AdamParams(learning_rate=1e-4)).result(),
            "sample": lambda: sampler.sample(types.ModelInput.from_ints(tokens[:16]), 4, params).result(),
        }
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.latency_iters):
            for name, call in calls.items():
                started = time.perf_counter()
                call()
                times[name].append((time.perf_counter() - started) * 1000)
    finally:
        service.close("success").result()
    return {
        name: {"p50_ms": float(np.percentile(t, 50)), "p99_ms": float(np.percentile(t, 99)), "n": len(t)}
        for name, t in times.items()
    }


def within_noise(a: float, b: float, n: int) -> bool:
    """|a - b| <= 2 standard errors of the difference of two success rates over ``n`` prompts each (at least one
    prompt's worth, so two perfect or two zero rates are equal)."""
    se = math.sqrt((a * (1 - a) + b * (1 - b)) / n)
    return abs(a - b) <= max(2 * se, 1 / n)


def main() -> None:
    from opentinker.server.tinker.core import DISPLAY_NAMES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--eval-prompts", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--base", default="smollm2", help="'smollm2' (the bench) or 'tiny' (a smoke test).")
    parser.add_argument("--builtin-backend", choices=("ray", "local"), default="ray")
    parser.add_argument("--workers", type=int, default=2, help="The built-in GRPO's rollout workers.")
    parser.add_argument("--server-threads", type=int, default=None, help="torch threads of the server's worker.")
    parser.add_argument("--latency-iters", type=int, default=30)
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "opentinker-test-llm-cache"))
    parser.add_argument("--out-dir", default="/tmp/opentinker-bench-tinker-api")
    parser.add_argument("--only", choices=("sdk", "builtin"), default=None, help="Run one half (no ratio then).")
    parser.add_argument(
        "--parts", default="ratio,throughput,clients,fairness,restart", help="Which parts to run (comma-separated)."
    )
    parser.add_argument("--throughput-steps", type=int, default=10)
    parser.add_argument("--clients", default="1,2,4", help="The client counts of the part 'clients'.")
    parser.add_argument("--client-steps", type=int, default=6)
    parser.add_argument("--client-group", type=int, default=8)
    parser.add_argument("--client-max-tokens", type=int, default=24)
    parser.add_argument("--fairness-steps", type=int, default=8)
    parser.add_argument("--fairness-long-tokens", type=int, default=256)
    parser.add_argument("--fairness-long-samples", type=int, default=8)
    parser.add_argument("--restart-steps", type=int, default=8)
    parser.add_argument("--restart-after", type=int, default=3)
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if parts - PARTS:
        parser.error(f"unknown parts: {sorted(parts - PARTS)}")
    if "restart" in parts and not 1 <= args.restart_after < args.restart_steps - 1:
        parser.error("--restart-after must leave at least two steps after the restart")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    load_at_start = round(os.getloadavg()[0], 2)  # figures count only from a quiet machine: say how busy it was
    sdk = builtin = latency = None
    extra = {}
    base = DISPLAY_NAMES[args.base]
    same_work = argparse.Namespace(**{**vars(args), "lr": 0.0, "steps": args.throughput_steps, "eval_prompts": 8})
    throughput = {}
    if parts - {"ratio", "throughput"} or args.only != "builtin":
        server = Server(
            Path(tempfile.mkdtemp(prefix="server-", dir=out)), args.base, args.cache_dir, args.server_threads
        )
        try:
            if "ratio" in parts and args.only != "builtin":
                key = server.key("bench")
                latency = latencies(args, server.url, key)
                print("latency (tiny model):", json.dumps(latency), flush=True)
                sdk = sdk_run(args, server.url, key)
                print("sdk:", json.dumps({k: v for k, v in sdk.items() if k != "curve"}), flush=True)
            if "throughput" in parts and args.only != "builtin":
                throughput["sdk"] = sdk_run(same_work, server.url, server.key("throughput"))
            if "clients" in parts:
                extra.update(clients_part(server, base, args))
            if "fairness" in parts:
                extra.update(fairness_part(server, base, args))
                print("fairness:", json.dumps({k: v for k, v in extra.items() if k.startswith("fairness")}), flush=True)
            if "restart" in parts:  # last: it kills the API
                extra.update(restart_part(server, base, args))
                print("restart:", json.dumps({k: v for k, v in extra.items() if k.startswith("api_")}), flush=True)
        finally:
            server.stop()
    if "ratio" in parts and args.only != "sdk":
        builtin = builtin_run(args)
        print("built-in:", json.dumps({k: v for k, v in builtin.items() if k != "curve"}), flush=True)
    if "throughput" in parts and args.only != "sdk":
        throughput["builtin"] = builtin_run(same_work)
    (out / "curves.json").write_text(json.dumps({"sdk": sdk, "builtin": builtin}, indent=1))
    halves = {"sdk": sdk, "builtin": builtin}
    line = {
        "bench": "tinker_api",
        "parts": args.parts,
        "base": args.base,
        "steps": args.steps,
        "group_size": args.group_size,
        "prompts_per_step": args.prompts_per_step,
        "max_new_tokens": args.max_new_tokens,
        "lr": args.lr,
        "eval_prompts": args.eval_prompts,
        "builtin_backend": f"{args.builtin_backend} x{args.workers}",
        "load_avg_1m_start_end": [load_at_start, round(os.getloadavg()[0], 2)],
        **{f"{name}_{k}": v for name, half in halves.items() if half for k, v in half.items() if k != "curve"},
        **extra,
    }
    for name, half in throughput.items():
        line[f"throughput_{name}_completions_per_s"] = half["completions_per_s"]
        line[f"throughput_{name}_completion_tokens_per_s"] = half["completion_tokens_per_s"]
    if sdk and builtin:
        line["completions_per_s_ratio"] = sdk["completions_per_s"] / builtin["completions_per_s"]
        line["completion_tokens_per_s_ratio"] = sdk["completion_tokens_per_s"] / builtin["completion_tokens_per_s"]
        line["heldout_equal_within_noise"] = within_noise(
            sdk["heldout_after"], builtin["heldout_after"], args.eval_prompts
        )
    if len(throughput) == 2:
        ratio = throughput["sdk"]["completions_per_s"] / throughput["builtin"]["completions_per_s"]
        line["throughput_ratio"] = ratio
        line["ratio_floor"] = RATIO_FLOOR
        line["ratio_ok"] = ratio >= RATIO_FLOOR
    if latency:
        line["latency_tiny_ms"] = latency
    line["rerun"] = rerun_command("tinker_api.py", args)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
