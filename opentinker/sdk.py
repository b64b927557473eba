"""The SDK's trainers: the RL core's trainers (PPO, DQN, SAC, TD3) plus what sits above the RL core: the CLI's preset
for an env id, ``train(track=True)`` (the pipeline's MLflow layout) and ``deploy()`` (an authenticated HTTP service);
and ``GRPOTrainer`` for a language model on a text env.

The RL core (``opentinker.agents``) stays free of presets, tracking and serving code.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from opentinker.agents.dqn import DQN
from opentinker.agents.grpo_trainer import GRPO
from opentinker.agents.ppo import PPO
from opentinker.agents.sac import SAC
from opentinker.agents.td3 import TD3


def preset_config(algorithm: str, env_id: str, fields: dict[str, Any], steps: int | None = None) -> Any:
    """The config ``opentinker train env_id --algo algorithm [--steps steps]`` trains with (the same resolution as a
    run's spec: the preset for the env's kind of problem, for a user's env under the budget table's row), ``fields``
    over it."""
    from opentinker.flows.presets import resolve_spec
    from opentinker.tasks.spec import RunSpec

    spec = RunSpec(env_id=env_id, steps=steps, engine={"algorithm": algorithm, **fields})
    return resolve_spec(spec).engine.config()


class _Preset:
    """Mixin: an env given by id trains with the CLI's preset for it; keyword arguments override its fields. An env
    object keeps the config's defaults (a preset is tuned for its own number of env copies).

    The budget is known only at ``train(steps)``: until then the trainer has the preset without it (the family's);
    the first ``train`` resolves again with the steps, as ``opentinker train ENV --steps N`` does, and rebuilds the
    untrained trainer when that changes a setting (a user's env: the budget table)."""

    def __init__(
        self,
        env: Any,
        policy: str = "MLP",
        seed: int = 0,
        device: str = "auto",
        amp_mode: str | None = None,
        config: Any = None,
        **fields: Any,
    ):
        self._unbudgeted: tuple | None = None
        if isinstance(env, str) and config is None:
            self._unbudgeted = (env, policy, seed, device, amp_mode, fields)
            config, fields = preset_config(self.algorithm, env, fields), {}
        super().__init__(env, policy, seed, device, amp_mode, config=config, **fields)

    def train(self, steps: int | float, *args: Any, **kwargs: Any) -> dict[str, float]:
        if self._unbudgeted is not None and self.global_step == 0:
            from opentinker.agents.trainer import check_train_args

            env, policy, seed, device, amp_mode, fields = self._unbudgeted
            config = preset_config(self.algorithm, env, fields, check_train_args(steps, None, None))
            if config != self.config:
                self.env.close()
                _Preset.__init__(self, env, policy, seed, device, amp_mode, config=config)
        self._unbudgeted = None
        return super().train(steps, *args, **kwargs)


class _Deployable:
    """Mixin: ``deploy(api_key=...)`` exports the current policy and serves it with ``serving.deploy``."""

    def deploy(self, api_key: str, port: int | None = None, host: str = "127.0.0.1", **options: Any):
        """Serve the current policy on ``host:port`` (a free loopback port by default) behind ``api_key``.

        Returns a ``serving.deploy.Deployment`` (``url``, ``predict(obs)``, ``predict_batch(obs)``,
        ``stop()``; also a context manager). ``options`` go to ``serving.deploy.deploy`` (e.g.
        ``settings={"workers": 2}``). The export is written under ``<data_dir>/deployments/``.
        """
        from opentinker.agents.export import export_policy
        from opentinker.infra.settings import get_settings
        from opentinker.serving.deploy import deploy

        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = f"{self.algorithm}-{(self.env_id or 'env').replace('/', '_')}-step{self.global_step}-{stamp}"
        export_dir = Path(get_settings().resolved_data_dir) / "deployments" / name
        export_policy(self, export_dir, metadata={"global_step": int(self.global_step), "seed": int(self.seed)})
        return deploy(export_dir, api_key, host=host, port=port, **options)


class _Tracked:
    """Mixin: ``train(..., track=True)`` logs the run to the configured MLflow store the way ``train_flow`` does."""

    def train(
        self,
        steps: int,
        callback=None,
        checkpoint_dir=None,
        checkpoint_every: int | None = None,
        track: bool = False,
        **track_options: Any,
    ) -> dict[str, float]:
        """The RL core's ``train`` (returns the last iteration's metrics); with ``track=True`` (returns the evaluation)
        also params, per-iteration metrics, plots, config, model card,
        checkpoint and the registered model (alias ``candidate``) in MLflow, the same layout as a flow run.

        ``track_options``: ``run_name``, ``model_name``, ``experiment``, ``eval_episodes``, ``eval_seed``.
        Checkpoints then go to the run's directory (``<data_dir>/runs/<run_name>``); the run id is
        ``self.last_run_id``.
        """
        if not track:
            if track_options:
                raise ValueError(f"{sorted(track_options)} only apply with track=True")
            return super().train(steps, callback, checkpoint_dir, checkpoint_every)
        if checkpoint_dir is not None:
            raise ValueError("checkpoint_dir: with track=True checkpoints go to the run's directory")
        from opentinker.flows.tracked import train_tracked

        return train_tracked(self, steps, callback, checkpoint_every, **track_options)


class _Served:
    """Mixin: after ``opentinker.connect()`` ``train`` runs as a job on the server, and ``evaluate``/``deploy`` act on
    the job's registered model (``opentinker.server.remote``). Without a server, the local trainer as before."""

    remote_job = None

    def train(self, steps, callback=None, checkpoint_dir=None, checkpoint_every=None, track=False, **options):
        from opentinker.server.client import current

        client = current()
        if client is None:
            return super().train(steps, callback, checkpoint_dir, checkpoint_every, track=track, **options)
        if callback is not None or checkpoint_dir is not None or track or options:
            raise ValueError("callback, checkpoint_dir, track and run options apply to local training only")
        from opentinker.agents.trainer import check_train_args
        from opentinker.server.remote import train_remote

        return train_remote(self, client, check_train_args(steps, None, None))

    def evaluate(self, episodes: int = 10, seed: int = 10_000):
        if self.remote_job is None:
            return super().evaluate(episodes, seed)
        from opentinker.server.remote import evaluate_remote

        return evaluate_remote(self, episodes, seed)

    def deploy(self, api_key: str, **options: Any):
        if self.remote_job is None:
            return super().deploy(api_key, **options)
        from opentinker.server.remote import deploy_remote

        return deploy_remote(self, api_key)


class PPOTrainer(_Preset, _Served, _Tracked, _Deployable, PPO):
    """``PPOTrainer(env, policy="MLP", seed=0, device="auto", amp_mode="off", **PPOConfig fields)``: the RL core's
    ``PPO`` with the CLI's preset for an env id, ``train(track=True)``, ``deploy()``, and after
    ``opentinker.connect()`` training as a server job."""


class DQNTrainer(_Preset, _Served, _Tracked, _Deployable, DQN):
    """``DQNTrainer(env, policy="MLP", seed=0, device="auto", amp_mode="off", **DQNConfig fields)``: the RL core's
    ``DQN`` with the CLI's preset for an env id, ``train(track=True)``, ``deploy()``, and after
    ``opentinker.connect()`` training as a server job."""


class SACTrainer(_Preset, _Served, _Tracked, _Deployable, SAC):
    """``SACTrainer(env, policy="MLP", seed=0, device="auto", amp_mode="auto", **SACConfig fields)``: the RL core's
    ``SAC`` with the CLI's preset for an env id, ``train(track=True)``, ``deploy()``, and after
    ``opentinker.connect()`` training as a server job."""


class TD3Trainer(_Preset, _Served, _Tracked, _Deployable, TD3):
    """``TD3Trainer(env, policy="MLP", seed=0, device="auto", amp_mode="auto", **TD3Config fields)``: the RL core's
    ``TD3`` with the CLI's preset for an env id, ``train(track=True)``, ``deploy()``, and after
    ``opentinker.connect()`` training as a server job."""


class GRPOTrainer(GRPO):
    """``GRPOTrainer(env, base_model="smollm2", seed=0, workers=1, backend="local", **GRPOConfig fields)``: GRPO on
    a text env — a shipped task's name, ``"package.module:factory"``, or your own ``TextEnv`` factory (called with
    ``split``: "train" or "heldout") or instance. ``train(updates)`` counts optimiser updates; ``evaluate()`` plays
    the held-out prompts greedily; ``save_adapter(dir)`` writes what ``opentinker agent serve --llm`` serves."""

    def __init__(
        self,
        env: Any = "arithmetic",
        base_model: str = "smollm2",
        seed: int = 0,
        workers: int = 1,
        backend: str = "local",
        **config: Any,
    ):
        from opentinker.agents.grpo import grpo_config
        from opentinker.envs.text_tasks import text_env_name

        grpo = grpo_config({**config, "task": text_env_name(env), "base_model": base_model})
        super().__init__(grpo, seed=seed, workers=workers, backend=backend, env=None if isinstance(env, str) else env)
