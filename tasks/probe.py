"""The env probe: before training, the env copies (placed as in training) step with a uniformly random policy.

In ``train_flow`` it runs once before training: it proves
the env builds and steps on the rollout workers (a bad env fails here, in seconds, not mid-training)
and gives the random-policy baseline return for the learning curve. Training itself collects its
rollouts inside the training loop (see ``tasks/train.py`` for why that loop is one task).
"""

from __future__ import annotations

import copy
import time

import numpy as np
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from opentinker.tasks.spec import RunSpec
from opentinker.tasks.types import ProbeSummary


@task(cache_policy=NO_CACHE)
def start_ray() -> str:
    """Start local Ray or join the configured cluster: its own step, so the UI shows what Ray's start-up costs."""
    import ray

    from opentinker.infra.ray_runtime import ensure_ray

    ensure_ray()
    resources = ray.cluster_resources()
    summary = f"{len(ray.nodes())} node(s), {resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs"
    get_run_logger().info("Ray ready: %s", summary)
    return summary


@task(cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def probe_env(spec: RunSpec, run_id: str | None = None, n_steps: int = 64) -> ProbeSummary:
    """``n_steps`` random-policy steps on every env copy of ``spec`` (placed as in training: in-process, or Ray actors
    for ``backend="ray"``); returns a summary, not the arrays."""
    from opentinker.envs import RemoteEnv
    from opentinker.infra.ray_runtime import rollout_actor_options

    engine, seed = spec.engine, spec.seed
    started = time.perf_counter()
    options = rollout_actor_options(spec.rollout_num_cpus, spec.rollout_num_gpus) if engine.backend == "ray" else None
    env = RemoteEnv(
        spec.env_id,
        parallel=engine.num_envs,
        workers=engine.workers,
        backend=engine.backend,
        seed=seed,
        ray_options=options,
    )
    capacity_wait_s = time.perf_counter() - started  # placing the actors, autoscaler launches included
    try:
        env.reset(seed=seed)
        space = copy.deepcopy(env.single_action_space)  # any kind of space samples uniformly with its own RNG,
        space.seed(seed)  # here tied to the run's seed
        running = np.zeros(env.num_envs)
        finished: list[float] = []
        for _ in range(n_steps):
            actions = np.stack([space.sample() for _ in range(env.num_envs)])
            _, rewards, terminated, truncated, _ = env.step(actions)
            done = np.logical_or(terminated, truncated)
            running += rewards
            finished.extend(running[done].tolist())
            running[done] = 0.0
    finally:
        env.close()
    mean_return = float(np.mean(finished)) if finished else None
    if run_id and (mean_return is not None or options):
        import mlflow

        from opentinker.tracking.runs import configure_mlflow, log_capacity_wait

        configure_mlflow()
        client = mlflow.MlflowClient()
        if mean_return is not None:
            client.log_metric(run_id, "charts/random_policy_return", mean_return, step=0)
        if options:
            log_capacity_wait(client, run_id, capacity_wait_s)
    from opentinker.tasks.train import run_log

    run_log().info("random-policy probe: %d episodes, mean return %s", len(finished), mean_return)
    return ProbeSummary(
        steps=n_steps * env.num_envs,
        episodes=len(finished),
        mean_return=mean_return,
        seconds=time.perf_counter() - started,
    )
