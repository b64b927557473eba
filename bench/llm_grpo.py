"""OpenTinker GRPO vs TRL's GRPO: same base model, task, prompts, group size, max new tokens, lr, steps.

    .venv/bin/python bench/llm_grpo.py --steps 12          # ~25 min on 2 busy cores; prints a table + one JSON line

Both train a LoRA adapter (same rank, alpha, target modules) on SmolLM2-135M-Instruct for ``arithmetic``'s train
split with the same verifier (exact integer), no KL term, token-level loss (TRL ``loss_type="dapo"``), group-normalised
advantages, one optimiser pass per batch, and the same sampling (temperature, top_k=0, top_p=1). OpenTinker samples on
Ray rollout workers (one torch thread each); TRL samples in its own process. Held-out success is measured for both the
same way: greedy, the first ``--eval-prompts`` held-out prompts, base + merged adapter, no constrained decoding.
Differences: OpenTinker's env allows a ``python_repl`` call (two turns), TRL sees one turn; TRL draws its own
prompt order from the same train split.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from grpo_common import builtin_grpo, half_figures, point, rerun_command  # bench/ is sys.path[0]

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def opentinker_run(args) -> dict:
    return builtin_grpo(args, "smollm2", "ray", "opentinker")


def trl_run(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from opentinker.agents.config import GRPOConfig as BuiltinConfig
    from opentinker.agents.grpo_trainer import summarise
    from opentinker.agents.lm_policy import load_tokenizer
    from opentinker.agents.lm_rollout import POLICY, evaluate_model
    from opentinker.agents.lm_sampler import HFSampler
    from opentinker.agents.lm_weights import converted_checkpoint
    from opentinker.agents.multi_lora import MultiLoraModel
    from opentinker.envs.text import TextExample, exact_integer
    from opentinker.envs.text_tasks import make_text_env, task_examples

    env = make_text_env("arithmetic")
    train = task_examples("arithmetic", "train")
    data = Dataset.from_list(
        [
            {
                "prompt": [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": e.prompt}],
                "answer": e.answer,
            }
            for e in train
        ]
    )

    def reward(prompts, completions, answer, **_):
        return [exact_integer(c[-1]["content"], TextExample("", a)) for c, a in zip(completions, answer)]

    peft_config = BuiltinConfig().lora.peft_config()  # the built-in GRPO's adapter
    peft_config.task_type = "CAUSAL_LM"
    tokenizer = load_tokenizer(args.cache_dir)
    model = AutoModelForCausalLM.from_pretrained(converted_checkpoint(None, args.cache_dir), dtype=torch.float32)
    config = GRPOConfig(
        output_dir=os.path.join(args.out_dir, "trl"),
        max_steps=args.steps,
        learning_rate=args.lr,
        per_device_train_batch_size=args.group_size * args.prompts_per_step,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_k=0,
        top_p=1.0,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        epsilon=0.2,
        num_iterations=1,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=args.seed,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
    )
    curve: list[dict] = []
    started: list[float] = []

    class Curve(TrainerCallback):
        def on_train_begin(self, *a, **k):
            started.append(time.perf_counter())

        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                point(curve, "trl", state.global_step, logs["reward"], time.perf_counter() - started[0])

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[Curve()],
        peft_config=peft_config,
    )
    began = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - (started[0] if started else began)
    adapter_dir = os.path.join(args.out_dir, "trl", "adapter")
    trainer.model.save_pretrained(adapter_dir)
    policy = MultiLoraModel("smollm2", args.cache_dir)
    policy.load(POLICY, adapter_dir)
    indices = list(range(args.eval_prompts))
    episodes = evaluate_model(HFSampler(policy), POLICY, "arithmetic", 0, indices, args.max_new_tokens, 16)
    after = summarise(episodes).success
    return half_figures(args, seconds, curve, after)


def plot_curves(results: dict, path: str) -> str:
    """Train reward (mean of the last 5 steps) against wall time, one line per side, held-out success as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for name, r in results.items():
        rewards = [p["reward"] for p in r["curve"]]
        smooth = [
            sum(rewards[max(0, i - 4) : i + 1]) / len(rewards[max(0, i - 4) : i + 1]) for i in range(len(rewards))
        ]
        minutes = [p["seconds"] / 60 for p in r["curve"]]
        (line,) = ax.plot(minutes, smooth, label=f"{name}: train reward (5-step mean)")
        if r.get("heldout_before") is not None:
            ax.scatter([0, minutes[-1]], [r["heldout_before"], r["heldout_after"]], color=line.get_color(), marker="s")
    ax.set(xlabel="minutes of training", ylabel="reward / held-out success (squares)", ylim=(0, 1))
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--eval-prompts", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=None, help="De-quantised SmolLM2 cache (default <data_dir>/llm-cache).")
    parser.add_argument("--out-dir", default="/tmp/opentinker-bench-llm-grpo")
    parser.add_argument("--only", choices=("opentinker", "trl"), default=None)
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    load_at_start = round(os.getloadavg()[0], 2)  # the figures only count on a quiet machine: say how busy it was
    results = {}
    if args.only in (None, "opentinker"):
        results["opentinker"] = opentinker_run(args)
        import ray

        ray.shutdown()
        print("opentinker:", json.dumps({k: v for k, v in results["opentinker"].items() if k != "curve"}), flush=True)
    if args.only in (None, "trl"):
        results["trl"] = trl_run(args)
        results["trl"]["heldout_before"] = results.get("opentinker", {}).get("heldout_before")
        print("trl:", json.dumps({k: v for k, v in results["trl"].items() if k != "curve"}), flush=True)
    with open(os.path.join(args.out_dir, "curves.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    print("learning curve:", plot_curves(results, os.path.join(args.out_dir, "curve.png")), flush=True)
    print(f"{'':12} {'completions/s':>14} {'s/step':>8} {'held-out before':>16} {'after':>7}")
    for name, r in results.items():
        before = "n/a" if r.get("heldout_before") is None else f"{r['heldout_before']:.3f}"
        print(f"{name:12} {r['completions_per_s']:14.3f} {r['s_per_step']:8.1f} {before:>16} {r['heldout_after']:7.3f}")
    line = {
        "bench": "llm_grpo",
        "steps": args.steps,
        "group_size": args.group_size,
        "prompts_per_step": args.prompts_per_step,
        "max_new_tokens": args.max_new_tokens,
        "lr": args.lr,
        "eval_prompts": args.eval_prompts,
        "load_avg_1m_start_end": [load_at_start, round(os.getloadavg()[0], 2)],
        **{f"{n}_{k}": v for n, r in results.items() for k, v in r.items() if k != "curve"},
    }
    if len(results) == 2:
        ours, theirs = results["opentinker"]["completions_per_s"], results["trl"]["completions_per_s"]
        line["completions_per_s_ratio"] = ours / theirs
    line["rerun"] = rerun_command("llm_grpo.py", args)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
