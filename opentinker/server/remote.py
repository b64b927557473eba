"""The SDK's trainers after ``opentinker.connect()``: ``train`` is a server job, ``evaluate`` and ``deploy`` act on the
job's registered model.

``PPOTrainer(RemoteEnv('CartPole-v1'), policy='MLP').train(steps=1e6)`` submits the trainer's own config (its
algorithm, every engine field, its env copies and seed) as the job's spec, so the job trains what this process would
have trained, shows its progress here and returns when the job ends. Its registered policy is then downloaded
(numpy weights, no code), so ``evaluate()`` plays this machine's env with exactly the registered version, and
``deploy(api_key=...)`` starts a policy service for that version on the server, reachable with the chosen key
(only its hash leaves this process) or the tenant's keys.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .client import Client
from .watch import follow


class JobFailed(RuntimeError):
    """The server job did not succeed; the message names its state and why."""


@dataclass
class RemoteJob:
    """A finished server job as the trainer keeps it: its status, result and downloaded policy."""

    client: Client
    job: dict[str, Any]
    result: dict[str, Any]
    policy_dir: Path


def job_spec(trainer: Any, steps: int) -> dict[str, Any]:
    """The trainer's configuration as a job spec in config form: every field of its config (``EngineSpec.of``), so the
    job trains what this process would have trained."""
    from opentinker.tasks.spec import MEMBERS, RunSpec

    if ":" in trainer.env_id and trainer.env_id.split(":")[0] == "__main__":
        raise ValueError(
            f"env_id: {trainer.env_id!r} is defined in the script you run; a server job imports your env from a "
            "package: move the class into a module of a package and import it from there"
        )
    engine = MEMBERS[trainer.algorithm].of(trainer.config)
    spec = RunSpec(env_id=trainer.env_id, steps=steps, seed=trainer.seed, engine=engine)
    return {k: v for k, v in spec.config_form().items() if k not in ("resume", "resolved")}


def train_remote(trainer: Any, client: Client, steps: int) -> dict[str, float]:
    """Run the trainer's training as a server job and wait for it; the evaluation figures of the registered model."""
    job = client.submit(job_spec(trainer, steps))
    final = follow(client, job)
    if final["state"] != "SUCCEEDED":
        raise JobFailed(f"job {final['id']} {final['state']}: {final['reason']}")
    result = client.result(final["id"])
    policy_dir = client.policy(final["id"], Path(tempfile.mkdtemp(prefix=f"opentinker-{final['id']}-")))
    trainer.remote_job = RemoteJob(client, final, result, policy_dir)
    trainer.global_step = int(result.get("global_step") or steps)
    return {"eval/mean_return": result["eval_mean"], "eval/std_return": result["eval_std"]}


def evaluate_remote(trainer: Any, episodes: int, seed: int):
    """The engine's evaluation of the job's registered policy on this machine's env copies."""
    from opentinker.agents.evaluation import evaluate_episodes
    from opentinker.agents.export import load_policy

    policy = load_policy(trainer.remote_job.policy_dir)
    env = trainer.env
    return evaluate_episodes(env.env, policy.act, episodes, seed, **env.env_kwargs)


@dataclass
class RemoteService:
    """A policy service on the server for the job's registered version: ``url``, ``predict(obs)``, ``stop()``."""

    client: Client
    service: dict[str, Any]
    api_key: str = field(repr=False)

    @property
    def url(self) -> str:
        return self.service["url"]

    def predict(self, obs: Any) -> Any:
        import httpx

        answer = httpx.post(
            f"{self.url}/act",
            json={"obs": np.asarray(obs).tolist()},
            headers={"Authorization": f"Bearer {self.api_key}"},
            timeout=30,
        )
        answer.raise_for_status()
        return answer.json()["action"]

    def stop(self) -> None:
        self.client.stop_service(self.service["id"])

    def __enter__(self) -> RemoteService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def deploy_remote(trainer: Any, api_key: str) -> RemoteService:
    from opentinker.serving.auth import hash_api_key

    remote = trainer.remote_job
    service = remote.client.deploy(remote.job["id"], hash_api_key(api_key))
    return RemoteService(remote.client, service, api_key)
