"""What bench/llm_grpo.py and bench/tinker_api.py share: the built-in GRPO half, a half's figures and the JSON line's
rerun command. A bench imports it as a sibling module (``bench/`` is ``sys.path[0]`` when a bench runs)."""

from __future__ import annotations

import argparse
import time


def point(curve: list, name: str, step: int, reward: float, seconds: float, tokens: int | None = None) -> None:
    """One learning-curve point, kept and printed as it happens (a long run shows progress); ``tokens``: the
    completion tokens the step sampled."""
    curve.append({"step": step, "reward": float(reward), "seconds": seconds, "tokens": tokens})
    print(f"{name} step {step}: train reward {float(reward):.3f} at {seconds:.0f} s", flush=True)


def half_figures(
    args: argparse.Namespace, seconds: float, curve: list, after: float, before: float | None = None
) -> dict:
    """A half's figures over ``args.steps`` steps of ``group_size x prompts_per_step`` completions in ``seconds``:
    throughput, held-out success (``before`` only where that half measured it) and the learning curve.

    Completions/s depends on what the policy learned to write (a longer reply, another turn); completion tokens/s,
    where the curve has them, is the same work whatever the policy does."""
    completions = args.steps * args.group_size * args.prompts_per_step
    figures = {"completions_per_s": completions / seconds, "s_per_step": seconds / args.steps}
    if curve and all(p.get("tokens") is not None for p in curve):
        figures["completion_tokens_per_s"] = sum(p["tokens"] for p in curve) / seconds
    if before is not None:
        figures["heldout_before"] = before
    return {**figures, "heldout_after": after, "curve": curve}


def builtin_grpo(args: argparse.Namespace, base_model: str, backend: str, name: str) -> dict:
    """The built-in GRPO on ``arithmetic`` as both benches run it (no KL term, token-level loss), held-out success
    measured before and after; ``name`` labels its progress lines."""
    from opentinker.agents.grpo import GRPOConfig
    from opentinker.agents.grpo_trainer import GRPO

    config = GRPOConfig(
        task="arithmetic",
        base_model=base_model,
        group_size=args.group_size,
        prompts_per_step=args.prompts_per_step,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        learning_rate=args.lr,
        kl_coef=0.0,
        loss_norm="token",
        eval_prompts=args.eval_prompts,
        cache_dir=args.cache_dir,
    )
    trainer = GRPO(config, seed=args.seed, workers=args.workers, backend=backend)
    try:
        before = trainer.evaluate(base=True).success
        curve: list[dict] = []
        started = time.perf_counter()
        trainer.train(
            args.steps,
            callback=lambda metrics, step: point(
                curve,
                name,
                step,
                metrics["train/reward_mean"],
                time.perf_counter() - started,
                round(metrics["train/response_tokens"] * args.group_size * args.prompts_per_step),
            ),
        )
        seconds = time.perf_counter() - started
        after = trainer.evaluate().success
    finally:
        trainer.close()
    return half_figures(args, seconds, curve, after, before)


def rerun_command(script: str, args: argparse.Namespace) -> str:
    """The command that reruns ``bench/<script>`` with these arguments (the output and cache folders left default)."""
    return f"python bench/{script} " + " ".join(
        f"--{k.replace('_', '-')} {v}"
        for k, v in vars(args).items()
        if v is not None and k not in ("out_dir", "cache_dir")
    )
