"""The SDK's trainers: the engine's ``PPOTrainer``/``DQNTrainer``/``SACTrainer``/``TD3Trainer`` plus ``deploy()``.

The engine (``opentinker.agents``) stays free of serving code; this facade adds the one method that
turns a trained policy into a running, authenticated HTTP service.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from opentinker.agents.dqn import DQNTrainer as _EngineDQNTrainer
from opentinker.agents.ppo import PPOTrainer as _EnginePPOTrainer
from opentinker.agents.sac import SACTrainer as _EngineSACTrainer
from opentinker.agents.td3 import TD3Trainer as _EngineTD3Trainer


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
        """The engine's ``train`` (returns the last iteration's metrics); with ``track=True`` (returns the evaluation)
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


class PPOTrainer(_Tracked, _Deployable, _EnginePPOTrainer):
    __doc__ = _EnginePPOTrainer.__doc__


class DQNTrainer(_Tracked, _Deployable, _EngineDQNTrainer):
    __doc__ = _EngineDQNTrainer.__doc__


class SACTrainer(_Tracked, _Deployable, _EngineSACTrainer):
    __doc__ = _EngineSACTrainer.__doc__


class TD3Trainer(_Tracked, _Deployable, _EngineTD3Trainer):
    __doc__ = _EngineTD3Trainer.__doc__
