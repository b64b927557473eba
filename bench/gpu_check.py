"""GPU check: PPO on CartPole-v1 with the learner on CUDA under each amp_mode, compared with fp32 (amp off).

One short prepared script (well under 5 minutes on a GPU). Every mode trains the same budget from the same seed
(local env backend, so only the learner's precision differs) and is checked against fp32, measured in the same
command:
  - first-update loss (same initial weights, same first rollout): |loss - fp32| <= FIRST_LOSS_RTOL * |fp32| + 0.01;
  - final loss (last iteration): finite and within a factor FINAL_LOSS_FACTOR of fp32 (late losses move with
    the policy, so only a gross error such as overflow or a dead learner fails);
  - evaluation (10 deterministic episodes, seeds 10000..): |return - fp32| <= max(EVAL_RTOL * fp32, EVAL_ATOL).
Throughput is env steps/s of training wall time; ``speedup`` is each mode's steps/s over fp32's.
Without CUDA it prints {"cuda": false, ...} and exits 0. Exit 1 when a check fails.

    .venv/bin/python bench/gpu_check.py [--steps 150000] [--seed 1] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

MODES = ("off", "bf16", "fp16", "safe")
PPO_SETTINGS = dict(
    num_envs=128,
    n_steps=32,
    learning_rate=1.5e-3,
    gamma=0.98,
    gae_lambda=0.8,
    ent_coef=0.0,
    num_minibatches=4,
    update_epochs=4,
    backend="local",
)
"""The lean CartPole settings of bench/ppo_throughput.py (solves in ~100-200k steps), envs stepped in-process."""
FIRST_LOSS_RTOL, FINAL_LOSS_FACTOR, EVAL_RTOL, EVAL_ATOL = 0.1, 3.0, 0.15, 50.0
EVAL_EPISODES, EVAL_SEED = 10, 10_000


def total_loss(metrics: dict[str, float], ppo) -> float:
    """The optimised objective, rebuilt from the iteration's mean loss terms."""
    return metrics["losses/policy"] - ppo.ent_coef * metrics["losses/entropy"] + ppo.vf_coef * metrics["losses/value"]


def run_mode(mode: str, steps: int, seed: int, device: str) -> dict[str, float]:
    from opentinker.agents import PPO

    trainer = PPO("CartPole-v1", seed=seed, device=device, amp_mode=mode, total_steps=steps, **PPO_SETTINGS)
    first: dict[str, float] = {}

    def keep_first(metrics: dict[str, float], _step: int) -> None:
        if not first:
            first.update(metrics)

    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    last = trainer.train(steps, callback=keep_first)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    result = {
        "sps": trainer.global_step / seconds,
        "eval_return": float(trainer.evaluate(EVAL_EPISODES, EVAL_SEED).mean),
        "first_loss": total_loss(first, trainer.config),
        "final_loss": total_loss(last, trainer.config),
        "amp_active_at_end": bool(trainer.amp.active),
        "fallback_reason": trainer.amp.fallback_reason,
    }
    trainer.env.close()
    return result


def check(mode: dict, ref: dict) -> list[str]:
    """Names of the failed checks (empty: within tolerance of fp32)."""
    failed = []
    if abs(mode["first_loss"] - ref["first_loss"]) > FIRST_LOSS_RTOL * abs(ref["first_loss"]) + 0.01:
        failed.append("first_loss")
    final, ref_final = abs(mode["final_loss"]), abs(ref["final_loss"])
    if (
        not math.isfinite(final)
        or final > FINAL_LOSS_FACTOR * ref_final + 0.01
        or final < ref_final / FINAL_LOSS_FACTOR - 0.01
    ):
        failed.append("final_loss")
    if abs(mode["eval_return"] - ref["eval_return"]) > max(EVAL_RTOL * ref["eval_return"], EVAL_ATOL):
        failed.append("eval_return")
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150_000, help="Env steps per mode.")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", default="cuda", help="'cuda' (the check); 'cpu' only to try the script itself.")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            json.dumps(
                {
                    "cuda": False,
                    "torch": torch.__version__,
                    "reason": "torch.cuda.is_available() is false: no CUDA GPU/driver here, nothing checked",
                }
            )
        )
        return 0
    from rich.progress import Progress

    results: dict[str, dict] = {}
    with Progress() as progress:
        task = progress.add_task(f"PPO CartPole-v1 on {args.device}", total=len(MODES) + 1)
        warm_up = PPO_SETTINGS["num_envs"] * PPO_SETTINGS["n_steps"]  # CUDA context, kernels
        run_mode("off", warm_up, args.seed, args.device)
        progress.advance(task)
        for mode in MODES:
            progress.update(task, description=f"amp_mode={mode}")
            results[mode] = run_mode(mode, args.steps, args.seed, args.device)
            progress.advance(task)
    ref = results["off"]
    for mode, result in results.items():
        result["failed"] = check(result, ref)
        result["speedup"] = result["sps"] / ref["sps"]
        print(
            f"{mode:>4}: {result['sps']:9.0f} steps/s (x{result['speedup']:.2f})  eval {result['eval_return']:6.1f}  "
            f"first loss {result['first_loss']:.4f}  final loss {result['final_loss']:.4f}  "
            f"{'ok' if not result['failed'] else 'FAILED ' + ','.join(result['failed'])}",
            file=sys.stderr,
        )
    summary = {
        "cuda": args.device == "cuda",
        "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "steps": args.steps,
        "seed": args.seed,
        "ok": all(not r["failed"] for r in results.values()),
        **{f"sps_{m}": round(r["sps"], 1) for m, r in results.items()},
        **{f"speedup_{m}": round(r["speedup"], 3) for m, r in results.items()},
        **{f"eval_{m}": r["eval_return"] for m, r in results.items()},
        "modes": results,
    }
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
