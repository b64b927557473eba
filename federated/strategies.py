"""Flower strategies the OpenTinker way: weighted by local env steps, floor-sized sampling, resumable state."""

from __future__ import annotations

from flwr.serverapp.strategy import FedAdam, FedAvg, FedProx, Strategy

from opentinker.federated.config import FedConfig

WEIGHT_KEY = "num-steps"
"""Replies carry the env steps a site trained; FedAvg weights each site's update by it."""


def make_strategy(config: FedConfig) -> Strategy:
    """FedAvg / FedProx / FedAdam from ``flwr.serverapp.strategy`` sampling every connected site (fraction 1.0)."""
    common = dict(
        fraction_train=1.0,
        fraction_evaluate=1.0,
        min_train_nodes=config.min_replies,
        min_evaluate_nodes=config.min_replies,
        min_available_nodes=config.min_replies,
        weighted_by_key=WEIGHT_KEY,
    )
    if config.strategy == "fedprox":
        return FedProx(proximal_mu=config.proximal_mu, **common)
    if config.strategy == "fedadam":
        return FedAdam(eta=config.server_learning_rate, eta_l=config.server_learning_rate, **common)
    return FedAvg(**common)


def strategy_state(strategy: Strategy) -> dict:
    """The tensors a stateful strategy carries between rounds (FedAdam's first and second moments)."""
    return {name: dict(getattr(strategy, name)) for name in ("m_t", "v_t") if getattr(strategy, name, None)}


def restore_strategy_state(strategy: Strategy, state: dict) -> None:
    for name, tensors in state.items():
        setattr(strategy, name, dict(tensors))
