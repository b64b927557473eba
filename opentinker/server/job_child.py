"""Inside a job's sandbox: the tenant's code runs here, and its only way out is the attempt's channel.

The trusted attempt process (``attempt.py``) starts ``python -m opentinker.server.job_child`` in the sandbox with one
end of a socket pair on the descriptor ``OPENTINKER_CHANNEL_FD``. The child reads what to run (``Start``), runs every
step that touches the env — the probe, training, the exports, evaluation of the candidate, of the current champion
and of a random policy — and sends what the trusted side needs as typed messages: metrics per iteration, checkpoints
and exports as files, one result. It holds no credential, reaches no Prefect, MLflow or server, and writes only its
own scratch folder (``OPENTINKER_DATA_DIR``), which nothing trusted reads: files leave only through the channel.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

from opentinker.server.channel import (
    Channel,
    Evaluation,
    Failure,
    GroupResult,
    GRPOResult,
    LMEvaluation,
    Log,
    Metrics,
    PolicyResult,
    Result,
    folder_files,
)
from opentinker.tracking.runs import SystemSampler


class Reporter:
    """The child's side of the channel: metrics, checkpoints whenever the trainer rewrote them, files, logs."""

    def __init__(self, channel: Channel, root: Path):
        self.channel = channel
        self.checkpoints = root / "checkpoints"
        self._sent: dict[str, tuple[int, int]] = {}
        self._system = SystemSampler()

    def metrics(self, metrics: dict[str, float], step: int) -> None:
        values = {k: float(v) for k, v in metrics.items()} | self._system.sample()  # the learner's own perf/
        self.channel.send(Metrics(step=int(step), values=values))
        self.ship_checkpoints()

    def ship_checkpoints(self) -> None:
        """Send each checkpoint file the trainer wrote since the last call (written atomically: whole or absent; temp
        files and anything else are not the checkpoint's)."""
        if not self.checkpoints.is_dir():
            return
        for path in sorted(self.checkpoints.iterdir()):
            if not path.is_file() or path.name not in folder_files("checkpoints"):
                continue
            stat = path.stat()
            if self._sent.get(path.name) != (stat.st_mtime_ns, stat.st_size):
                self._sent[path.name] = (stat.st_mtime_ns, stat.st_size)
                self.channel.send_file(f"checkpoints/{path.name}", path)

    def folder(self, directory: Path, prefix: str) -> None:
        """Send the folder's files of its format (the channel refuses any other name); the rest stays here."""
        allowed = folder_files(prefix)
        for path in sorted(directory.iterdir()):
            if path.is_file() and path.name in allowed:
                self.channel.send_file(f"{prefix}/{path.name}", path)

    def log(self, line: str) -> None:
        self.channel.send(Log(line=line[:2000]))


def evaluation(result: Any) -> Evaluation:
    return Evaluation(
        returns=result.returns,
        seed=result.seed if result.seed is not None else 0,
        action=result.action,
        alternative_returns=result.alternative.returns if result.alternative is not None else None,
        mean_length=result.mean_length,
        terminated_fraction=result.terminated_fraction,
    )


def run_policy(spec: Any, report: Reporter, root: Path, champion_dir: str | None) -> PolicyResult:
    """Probe, train (resuming from the checkpoint the trusted side put in place), export, evaluate."""
    from opentinker.agents.build import build_trainer, env_copies, run_loop
    from opentinker.agents.export import export_policy
    from opentinker.infra.ray_runtime import learner_device, rollout_actor_options
    from opentinker.tasks.evaluate import evaluate_random_policy, reward_threshold
    from opentinker.tasks.probe import probe_env
    from opentinker.tasks.run import as_step
    from opentinker.tracking.registry import load_registered_policy

    probe = as_step(probe_env)(spec)
    if probe.mean_return is not None:
        report.metrics({"charts/random_policy_return": probe.mean_return}, 0)
    config = spec.engine.config()
    with learner_device(spec.num_gpus) as device:
        options = (
            rollout_actor_options(spec.rollout_num_cpus, spec.rollout_num_gpus) if config.backend == "ray" else None
        )
        env = env_copies(spec.env_id, spec.seed, config, options)
        try:
            trainer = build_trainer(env, spec.algorithm, config, spec.seed, root, device, True)
            start_step = int(trainer.global_step)
            seconds = run_loop(trainer, spec.steps, root, spec.checkpoint_every, report.metrics)
            export_dir = export_policy(trainer, root / "export", metadata={"env_id": spec.env_id})
        finally:
            env.close()
    report.ship_checkpoints()
    report.folder(export_dir, "export")
    episodes, seed = spec.eval_episodes, spec.eval_seed
    candidate = load_registered_policy(export_dir).evaluate(spec.env_id, episodes, seed)  # greedy and sampled
    threshold = spec.champion_threshold if spec.champion_threshold is not None else reward_threshold(spec.env_id)
    champion = None
    if champion_dir:
        champion = load_registered_policy(champion_dir).evaluate(spec.env_id, episodes, seed)  # as it is served
    floor = None
    if threshold is None and champion is None:
        floor = as_step(evaluate_random_policy)(spec.env_id, episodes, seed)
    return PolicyResult(
        start_step=start_step,
        global_step=int(trainer.global_step),
        train_seconds=seconds,
        evaluation=evaluation(candidate),
        champion_evaluation=evaluation(champion) if champion else None,
        random_evaluation=evaluation(floor) if floor else None,
        threshold=threshold,
    )


def run_group(spec: Any, report: Reporter, root: Path, champion_dir: str | None) -> GroupResult:
    """Train every agent kind together, export one policy per kind, evaluate each."""
    from opentinker.agents.checkpoint import CHECKPOINT_NAME
    from opentinker.tasks.multiagent import group_trainer

    checkpoint = root / "checkpoints" / CHECKPOINT_NAME
    trainer = group_trainer(spec, checkpoint)
    try:
        trainer.train(
            spec.steps,
            callback=report.metrics,
            checkpoint_dir=checkpoint.parent,
            checkpoint_every=spec.checkpoint_every,
        )
        exports = trainer.export(root / "export", metadata={"env_id": spec.env_id})
        evaluations = trainer.evaluate(spec.eval_episodes, spec.eval_seed)
        global_step = int(trainer.global_step)
    finally:
        trainer.close()
    report.ship_checkpoints()
    for kind, directory in exports.items():
        report.folder(Path(directory), f"exports/{kind}")
    return GroupResult(global_step=global_step, evaluations={k: evaluation(v) for k, v in evaluations.items()})


def run_grpo(spec: Any, report: Reporter, root: Path, champion_dir: str | None) -> GRPOResult:
    """Probe the text env, train the adapter (held-out success of the base first), evaluate it and the champion."""
    import time

    from opentinker.agents.checkpoint import CHECKPOINT_NAME
    from opentinker.tasks.llm import evaluate_adapter, grpo_trainer, probe_text_env
    from opentinker.tasks.run import as_step

    grpo = spec.engine
    config = grpo.config(task=spec.env_id)
    as_step(probe_text_env)(spec.env_id, config.task_seed)
    checkpoint = root / "checkpoints" / CHECKPOINT_NAME
    trainer = grpo_trainer(spec, checkpoint)

    def lm(result: Any) -> LMEvaluation:
        return LMEvaluation(
            success=result.success,
            mean_reward=result.mean_reward,
            valid_tool_call_rate=result.valid_tool_call_rate,
            response_tokens=result.mean_response_tokens,
            prompts=config.eval_prompts,
        )

    def heldout(result: Any, update: int) -> None:
        values = {"success_rate": result.success, "reward_mean": result.mean_reward}
        values |= {"valid_tool_call_rate": result.valid_tool_call_rate, "response_tokens": result.mean_response_tokens}
        report.metrics({f"eval/{k}": v for k, v in values.items()}, update)

    try:
        start_completions, base = trainer.completions, None
        if trainer.updates == 0:
            result = trainer.evaluate(base=True)
            heldout(result, 0)
            base = lm(result)

        def callback(metrics: dict[str, float], update: int) -> None:
            report.metrics(metrics, update)
            if grpo.eval_every and update % grpo.eval_every == 0 and update < grpo.updates:
                heldout(trainer.evaluate(), update)

        started = time.perf_counter()
        trainer.train(
            grpo.updates, callback=callback, checkpoint_dir=checkpoint.parent, checkpoint_every=spec.checkpoint_every
        )
        seconds = time.perf_counter() - started
        adapter = trainer.save_adapter(root / "adapter")
        done, updates = trainer.completions - start_completions, trainer.updates
    finally:
        trainer.close()
    report.ship_checkpoints()
    report.folder(adapter, "adapter")
    candidate = as_step(evaluate_adapter)(str(adapter), config.eval_prompts, config.eval_batch, config.cache_dir)
    report.metrics({"heldout/success_rate": candidate.success, "heldout/reward_mean": candidate.mean_reward}, updates)
    champion = None
    if champion_dir:
        champion = as_step(evaluate_adapter)(
            champion_dir, config.eval_prompts, config.eval_batch, config.cache_dir
        ).success
    return GRPOResult(
        updates=updates,
        train_seconds=seconds,
        completions_per_s=done / max(seconds, 1e-9),
        evaluation=LMEvaluation(**candidate.model_dump()),
        base_evaluation=base,
        champion_success=champion,
    )


RUNNERS = {"grpo": run_grpo, "group": run_group}


def run(channel: Channel) -> Result:
    from opentinker.flows.presets import resolve_spec
    from opentinker.tasks.spec import RunSpec
    from opentinker.tasks.train import spec_dir

    start = channel.receive_start()
    spec = resolve_spec(RunSpec.model_validate(start.spec))
    root = spec_dir(spec)
    root.mkdir(parents=True, exist_ok=True)
    runner = RUNNERS.get(spec.algorithm, run_policy)
    return runner(spec, Reporter(channel, root), root, start.champion_dir)


def main() -> None:
    """Run, send the result or the failure, then exit at once (``os._exit``): everything is sent, and the
    interpreter's teardown (torch's, Ray's) would only delay the attempt."""
    channel = Channel.from_fd(int(os.environ.pop("OPENTINKER_CHANNEL_FD")))
    os.dup2(2, 1)  # stray prints go to stderr, which the attempt logs line by line
    code = 0
    try:
        channel.send(run(channel))
    except BaseException:
        code = 1
        try:
            channel.send(Failure(error=traceback.format_exc()[-8000:]))
        except OSError:
            pass
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
