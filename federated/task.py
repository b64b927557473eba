"""The ML a site runs, with no Flower in it: build the site's env variant, train the policy locally for a time/step
budget starting from the global weights (PPO on the env, or behaviour cloning on the site's offline dataset), score
a policy on the site's env. Calls the RL core (``opentinker.agents``).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import gymnasium as gym
import numpy as np

if TYPE_CHECKING:
    from opentinker.agents.bc import BCConfig, Transitions

Weights = dict[str, np.ndarray]

TRAIN_METRICS = ("num-steps", "seconds", "train-return", "train-loss")
"""Keys of every site's train reply, PPO or behaviour cloning alike: Flower's strategies refuse to aggregate replies
whose metric keys differ. A value that does not apply to the site's kind of training is NaN."""


class WeightShapeError(ValueError):
    """A weight dict does not match the model's parameter names/shapes; the message lists every difference."""


@dataclass(frozen=True)
class SiteVariant:
    """The physics of one site's CartPole: what makes sites' data differ (non-IID)."""

    pole_length: float
    """Half pole length (gymnasium's default is 0.5)."""
    gravity: float
    """Gravity (gymnasium's default is 9.8)."""


def default_variant(site_id: int) -> SiteVariant:
    """Site i gets a pole 30% longer and gravity 10% stronger than site i-1, centred on gymnasium's defaults."""
    offset = (site_id % 5) - 1
    return SiteVariant(pole_length=round(0.5 * (1 + 0.3 * offset), 4), gravity=round(9.8 * (1 + 0.1 * offset), 4))


def resolve_variant(site_id: int, pole_length: float, gravity: float) -> SiteVariant:
    """A site's explicit settings win; negative values fall back to the site's default variant."""
    default = default_variant(site_id)
    return SiteVariant(
        pole_length if pole_length > 0 else default.pole_length, gravity if gravity > 0 else default.gravity
    )


def make_site_env(env_id: str, variant: SiteVariant) -> gym.Env:
    """A gymnasium env with the site's physics (CartPole-family attributes; other envs are used as they are)."""
    env = gym.make(env_id)
    core = env.unwrapped
    if hasattr(core, "length") and hasattr(core, "gravity"):
        core.length = variant.pole_length
        core.gravity = variant.gravity
        core.polemass_length = core.masspole * core.length
    return env


SITE_PPO = dict(num_envs=8, n_steps=64, learning_rate=1e-3, anneal_lr=False, backend="local", torch_threads=1)
"""Local PPO settings of every site: in-process envs (no Ray inside a site's ClientApp), one torch thread, and a
constant learning rate because a site trains in many short slices whose total length it does not know."""


def new_trainer(env_id: str, variant: SiteVariant, seed: int, state_path: Path | None = None):
    """The site's PPO trainer: resumed from its local state file when there is one (optimiser, RNG, step counter)."""
    from opentinker.agents.ppo import PPO

    env = functools.partial(make_site_env, env_id, variant)
    if state_path is not None and state_path.exists():
        return PPO.load(state_path, env=env, device="cpu")
    return PPO(env, policy="MLP", seed=seed, device="cpu", **SITE_PPO)


def get_weights(trainer) -> Weights:
    return {name: tensor.detach().cpu().numpy().copy() for name, tensor in trainer.policy.state_dict().items()}


def check_shapes(expected: Weights, got: Weights, source: str) -> None:
    """Raise WeightShapeError naming every missing, extra or differently shaped tensor."""
    problems = [f"missing {k!r}" for k in expected if k not in got]
    problems += [f"unexpected {k!r}" for k in got if k not in expected]
    problems += [
        f"{k!r} has shape {tuple(got[k].shape)}, expected {tuple(v.shape)}"
        for k, v in expected.items()
        if k in got and tuple(got[k].shape) != tuple(v.shape)
    ]
    if problems:
        raise WeightShapeError(f"{source}: weights do not match the model: " + "; ".join(problems))


def set_weights(trainer, weights: Weights) -> None:
    import torch

    check_shapes(get_weights(trainer), weights, "set_weights")
    trainer.policy.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in weights.items()})


def _proximal_step(trainer, anchor: Weights, mu: float) -> None:
    """Exact proximal operator of (mu/2)·||w - w_global||² with unit step: w <- (w + mu·w_global) / (1 + mu)."""
    import torch

    with torch.no_grad():
        for name, param in trainer.policy.named_parameters():
            if name in anchor:
                param.mul_(1.0 / (1.0 + mu)).add_(torch.as_tensor(anchor[name]), alpha=mu / (1.0 + mu))


def train_local(
    trainer, seconds: float, max_steps: int, proximal_mu: float = 0.0, anchor: Weights | None = None
) -> dict:
    """Train until `seconds` have passed or `max_steps` env steps are done (at least one PPO iteration).

    With ``proximal_mu > 0`` every iteration ends with a proximal pull toward ``anchor`` (FedProx).
    Returns the ``TRAIN_METRICS`` (``train-loss`` is NaN: PPO has no supervised loss).
    """
    start_step = trainer.global_step
    deadline = time.monotonic() + seconds
    last_return = float("nan")

    def callback(metrics: dict[str, float], step: int) -> bool:
        nonlocal last_return
        last_return = metrics.get("charts/episodic_return_mean", last_return)
        if proximal_mu > 0 and anchor is not None:
            _proximal_step(trainer, anchor, proximal_mu)
        return time.monotonic() < deadline and step - start_step < max_steps

    started = time.monotonic()
    trainer.train(steps=start_step + max_steps, callback=callback)
    return {
        "num-steps": int(trainer.global_step - start_step),
        "seconds": time.monotonic() - started,
        "train-return": float(last_return),
        "train-loss": float("nan"),
    }


def bc_config(run_config) -> BCConfig:
    """The behaviour-cloning settings the server sent (``bc-*`` keys of the train message's config)."""
    from opentinker.agents.bc import BCConfig

    return BCConfig(
        epochs=int(run_config["bc-epochs"]),
        batch_size=int(run_config["bc-batch-size"]),
        learning_rate=float(run_config["bc-learning-rate"]),
        box_loss=str(run_config["bc-box-loss"]),
    )


def load_site_dataset(path: str | Path, trainer) -> Transitions:
    """The site's offline transitions, validated against the policy's spaces (``DatasetError`` names the field)."""
    from opentinker.agents.bc import load_transitions

    return load_transitions(path, trainer.observation_space, trainer.action_space)


def train_bc_local(
    trainer,
    data: Transitions,
    seconds: float,
    config: BCConfig,
    proximal_mu: float = 0.0,
    anchor: Weights | None = None,
) -> dict:
    """Behaviour cloning on the site's dataset for ``config.epochs`` or ``seconds``, whichever ends first.

    Returns the ``TRAIN_METRICS``: ``num-steps`` (the FedAvg weight) is the number of transitions in the dataset,
    ``train-return`` is NaN (no episodes are played). Shuffling draws from the trainer's RNG, which the site's state
    file carries between rounds.
    """
    from opentinker.agents.bc import behaviour_cloning

    stats = behaviour_cloning(
        trainer.policy,
        data,
        config,
        trainer.rng,
        deadline=time.monotonic() + seconds,
        anchor=anchor,
        proximal_mu=proximal_mu,
    )
    return {
        "num-steps": stats.num_samples,
        "seconds": stats.seconds,
        "train-return": float("nan"),
        "train-loss": stats.loss,
    }


def evaluate(trainer, episodes: int, seed: int = 10_000) -> float:
    """Mean return of deterministic actions over `episodes` episodes on the trainer's (site's) env."""
    return float(trainer.evaluate(episodes=episodes, seed=seed).mean)


def export_global_policy(env_id: str, weights: Weights, directory: Path, metadata: dict) -> Path:
    """Write the global model in the RL core's export format (policy.json + weights.npz) for the registry."""
    from opentinker.agents.export import export_policy

    trainer = new_trainer(env_id, default_variant(1), seed=0)
    set_weights(trainer, weights)
    return export_policy(trainer, directory, metadata=metadata)
