"""The Flower ClientApp a site runs: train the global policy on the site's own env (PPO) or on its own offline
dataset (behaviour cloning), or score it on the site's env.

Only weights and a few scalar metrics (env steps or dataset size, returns or loss, seconds) leave the site; the env,
its physics, the trajectories, the dataset and the local optimiser state stay in the site's process, its files and
its ``state-dir``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from logging import DEBUG
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import LocalDpMod
from flwr.common import log

from opentinker.federated import secure, task
from opentinker.federated.config import SiteConfig
from opentinker.infra.settings import get_settings


class SiteRefusedError(RuntimeError):
    """The site declines the server's request (e.g. a strategy it did not agree to); the reply says why."""


def to_record(weights: task.Weights) -> ArrayRecord:
    return ArrayRecord({name: Array(np.ascontiguousarray(value)) for name, value in weights.items()})


def from_record(record: ArrayRecord) -> task.Weights:
    return {name: array.numpy() for name, array in record.items()}


def _site(context: Context, sites: Sequence[SiteConfig] | None) -> SiteConfig:
    """A deployed site reads its node config; a simulated one picks its entry by Flower's partition id."""
    config = SiteConfig.from_node_config(dict(context.node_config))
    if sites is not None:
        return sites[config.site_id % len(sites)]
    return config


def _state_path(site: SiteConfig, context: Context) -> Path:
    root = Path(site.state_dir) if site.state_dir else get_settings().resolved_data_dir / "federated" / "site-state"
    path = root / f"run-{context.run_id}" / f"site-{site.site_id}" / "trainer.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _site_trainer(site: SiteConfig, context: Context, config, resume: bool):
    variant = task.resolve_variant(site.site_id, site.pole_length, site.gravity)
    state = _state_path(site, context) if resume else None
    trainer = task.new_trainer(
        str(config["env"]), variant, seed=int(config["seed"]) + 1000 * site.site_id, state_path=state
    )
    return trainer, variant


WORK_MARKER = "ClientApp work"
"""Starts the DEBUG line ``timing_mod`` writes; ``bench/federated_rounds.py --breakdown`` reads it in SuperNode logs."""


def timing_mod(msg: Message, context: Context, call_next) -> Message:
    """Log (DEBUG, with Flower's timestamps under ``FLWR_LOG_LEVEL=DEBUG``) when the app's own work on a message
    starts and ends, so a deployed round's time can be split into Flower's part and the app's."""
    log(DEBUG, "%s started: %s", WORK_MARKER, msg.metadata.message_type)
    started = time.perf_counter()
    reply = call_next(msg, context)
    log(DEBUG, "%s done: %s in %.3f s", WORK_MARKER, msg.metadata.message_type, time.perf_counter() - started)
    return reply


def build_client_app(sites: Sequence[SiteConfig] | None = None) -> ClientApp:
    """The ClientApp; ``sites`` (simulation only) gives each virtual site its settings, indexed by partition id."""
    app = ClientApp(mods=[timing_mod])

    def privacy_mod(msg: Message, context: Context, call_next) -> Message:
        """Local differential privacy when the site asks for it: clip, add Gaussian noise (Flower's LocalDpMod)."""
        site = _site(context, sites)
        if site.dp_clip <= 0:
            return call_next(msg, context)
        return LocalDpMod(site.dp_clip, site.dp_clip, site.dp_epsilon, site.dp_delta)(msg, context, call_next)

    @app.train(mods=[secure.secaggplus_site_mod, privacy_mod])  # DP noise is added before SecAgg+ masks the update
    def train(msg: Message, context: Context) -> Message:
        site = _site(context, sites)
        config = msg.content["config"]
        if site.strategy and site.strategy != config["strategy"]:
            raise SiteRefusedError(
                f"site {site.site_id} agreed to strategy {site.strategy!r} but the run uses {config['strategy']!r}"
            )
        trainer, _ = _site_trainer(site, context, config, resume=True)
        global_weights = from_record(msg.content["arrays"])
        task.set_weights(trainer, global_weights)
        seconds = float(config["aggregation-interval"])
        if site.aggregation_interval > 0:
            seconds = min(seconds, site.aggregation_interval)
        proximal_mu = float(config.get("proximal-mu", 0.0))
        if site.dataset:  # behaviour cloning on the site's offline transitions
            data = task.load_site_dataset(site.dataset, trainer)
            stats = task.train_bc_local(trainer, data, seconds, task.bc_config(config), proximal_mu, global_weights)
        else:
            stats = task.train_local(
                trainer,
                seconds=seconds,
                max_steps=int(config["local-steps"]),
                proximal_mu=proximal_mu,
                anchor=global_weights,
            )
        trainer.save(_state_path(site, context))
        metrics = MetricRecord({"site-id": site.site_id, **stats})
        return Message(RecordDict({"arrays": to_record(task.get_weights(trainer)), "metrics": metrics}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        site = _site(context, sites)
        config = msg.content["config"]
        trainer, _ = _site_trainer(site, context, config, resume=False)
        task.set_weights(trainer, from_record(msg.content["arrays"]))
        episodes = int(config["eval-episodes"])
        score = task.evaluate(trainer, episodes=episodes)
        metrics = MetricRecord({"site-id": site.site_id, "return": score, "num-steps": episodes})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    return app


app = build_client_app()
