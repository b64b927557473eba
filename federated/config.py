"""Typed run configuration of a federated run (the server side) and of one site (the client side).

Flower hands both around as flat ``key=value`` maps (``[tool.flwr.app.config]`` / ``flwr run --run-config`` for the
run, ``flower-supernode --node-config`` for a site); these dataclasses are the single place that reads them, with
kebab-case keys, and reject unknown keys or bad values with an error naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

STRATEGIES = ("fedavg", "fedprox", "fedadam")
BC_BOX_LOSSES = ("mse", "nll")


class FederatedConfigError(ValueError):
    """A run or site setting is unknown or out of range; the message names the field."""


def _from_mapping(cls, values: Mapping[str, Any], source: str):
    known = {f.name.replace("_", "-"): f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        name = key.replace("_", "-")
        if name not in known:
            raise FederatedConfigError(f"{source}: unknown key {key!r}; expected one of {sorted(known)}")
        f = known[name]
        expected = {"int": int, "float": float, "str": str, "bool": bool}[str(f.type).split(" ")[0]]
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise FederatedConfigError(f"{source}: {key!r} must be {expected.__name__}, got {value!r}")
        kwargs[f.name] = value
    return cls(**kwargs)


@dataclass
class FedConfig:
    """Server-side settings of one federated run (``[tool.flwr.app.config]`` in pyproject.toml)."""

    num_server_rounds: int = 3
    """Aggregation rounds to run in total (a resumed run continues up to this number)."""
    strategy: str = "fedavg"
    """Aggregation rule: 'fedavg' (weighted by local env steps), 'fedprox' (adds a proximal pull toward the global
    model during local training) or 'fedadam' (server-side Adam on the averaged update)."""
    num_sites: int = 3
    """Sites the federation is expected to have; the completion floor is a fraction of this number."""
    min_completion_rate: float = 0.66
    """Fraction of `num_sites` that must return a valid update for a round to count; fewer fails the run loudly."""
    aggregation_interval: float = 300.0
    """Seconds each site trains locally between two aggregations (a site may ask for less with its own setting)."""
    local_steps: int = 4096
    """Upper bound on env steps a site trains per round, so fast sites do not dominate by volume alone."""
    round_timeout: float = 900.0
    """Seconds the server waits for replies in one round; missing replies count as failures for the floor."""
    node_wait: float = 120.0
    """Seconds to wait before a round for all `num_sites` to be connected; after that, at least the floor must be."""
    eval_episodes: int = 5
    """Episodes each site runs (deterministic actions) to score the global model on its own env each round."""
    proximal_mu: float = 0.01
    """FedProx proximal coefficient mu (only used with strategy='fedprox')."""
    server_learning_rate: float = 0.05
    """FedAdam server step size eta (only used with strategy='fedadam')."""
    bc_epochs: int = 5
    """Dataset sites (behaviour cloning): passes over the site's transitions per round (also capped by
    `aggregation-interval` seconds)."""
    bc_batch_size: int = 64
    """Dataset sites: transitions per gradient step."""
    bc_learning_rate: float = 1e-3
    """Dataset sites: Adam learning rate of the behaviour-cloning update."""
    bc_box_loss: str = "mse"
    """Dataset sites with Box actions: 'mse' on the policy mean or 'nll' (Gaussian negative log-likelihood)."""
    secure_aggregation: bool = False
    """Aggregate with SecAgg+ (Flower's secure aggregation): the server only learns the weighted average of the
    sites' weights. FedAvg/FedProx only, at least 2 sites; the SecAgg+ reconstruction threshold is
    `min-completion-rate`."""
    secagg_max_weight: int = 0
    """SecAgg+: the largest `num-steps` (env steps or dataset transitions) a site may report; 0 means `local-steps`.
    Weights are quantised relative to it, so keep it close to the real sizes."""
    env: str = "CartPole-v1"
    """Gymnasium id of the task family; sites run (or evaluate on) their own variant of it."""
    seed: int = 0
    """Seed of the initial global model."""
    run_name: str = "federated"
    """Name of the MLflow parent run and of the server checkpoint folder (resume key)."""
    checkpoint_dir: str = ""
    """Server checkpoint folder; empty means <data_dir>/federated/<run_name>/server."""
    resume: bool = True
    """Continue from the last checkpointed round when a checkpoint exists."""
    register_as: str = "federated-policy"
    """MLflow registered-model name for the final global policy; empty skips registration."""
    alias: str = "federated"
    """Alias set on the registered version (the serving side loads models:/NAME@alias)."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise FederatedConfigError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if not 0.0 < self.min_completion_rate <= 1.0:
            raise FederatedConfigError(f"min-completion-rate must be in (0, 1], got {self.min_completion_rate}")
        if self.bc_box_loss not in BC_BOX_LOSSES:
            raise FederatedConfigError(f"bc-box-loss must be one of {BC_BOX_LOSSES}, got {self.bc_box_loss!r}")
        for name in ("num_server_rounds", "num_sites", "local_steps", "eval_episodes", "bc_epochs", "bc_batch_size"):
            if getattr(self, name) < 1:
                raise FederatedConfigError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("aggregation_interval", "round_timeout", "node_wait"):
            if getattr(self, name) <= 0:
                raise FederatedConfigError(f"{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}")
        if self.secure_aggregation and (self.strategy == "fedadam" or self.num_sites < 2):
            raise FederatedConfigError(
                f"secure-aggregation needs strategy fedavg or fedprox and num-sites >= 2, got {self.strategy!r} "
                f"with {self.num_sites} site(s)"
            )
        if self.secagg_max_weight < 0:
            raise FederatedConfigError(f"secagg-max-weight must be >= 0, got {self.secagg_max_weight}")
        if self.bc_learning_rate <= 0:
            raise FederatedConfigError(f"bc-learning-rate must be > 0, got {self.bc_learning_rate}")

    @property
    def min_replies(self) -> int:
        """The completion floor in sites: ceil(min_completion_rate * num_sites), at least one."""
        return max(1, math.ceil(self.min_completion_rate * self.num_sites - 1e-9))

    @classmethod
    def from_run_config(cls, values: Mapping[str, Any]) -> FedConfig:
        return _from_mapping(cls, values, "run config")

    def to_run_config(self) -> dict[str, Any]:
        return {k.replace("_", "-"): v for k, v in dataclasses.asdict(self).items()}


@dataclass
class SiteConfig:
    """One site's own settings (``flower-supernode --node-config``); none of it leaves the site."""

    site_id: int = 0
    """Index of the site in the federation (names its metrics on the server)."""
    pole_length: float = -1.0
    """Half pole length of this site's CartPole variant; negative picks the site's default variant."""
    gravity: float = -1.0
    """Gravity of this site's CartPole variant; negative picks the site's default variant."""
    dataset: str = ""
    """Path (on the site) to an .npz of offline transitions (`obs`, `actions`, ...): the site then trains by
    behaviour cloning on it instead of running PPO; its env variant is still where the global model is scored.
    Empty: the site trains PPO on its env variant. The file never leaves the site."""
    state_dir: str = ""
    """Folder for the site's local trainer state (optimiser, RNG) between rounds; empty keeps it in memory only."""
    aggregation_interval: float = 0.0
    """The site's own cap on seconds of local training per round; 0 follows the server's setting."""
    strategy: str = ""
    """The strategy this site agreed to take part in; a run with another strategy is refused. Empty accepts any."""
    dp_clip: float = 0.0
    """Local differential privacy: clip the update to this L2 norm and add Gaussian noise (0 disables)."""
    dp_epsilon: float = 1.0
    """Local DP privacy budget epsilon (smaller is more private, noisier)."""
    dp_delta: float = 1e-5
    """Local DP failure probability delta."""
    partition_id: int = -1
    """Set by Flower's simulation engine; used as the site id when `site_id` is not given."""
    num_partitions: int = 0
    """Set by Flower's simulation engine (number of virtual sites)."""

    def __post_init__(self) -> None:
        if self.strategy and self.strategy not in STRATEGIES:
            raise FederatedConfigError(f"site strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.dp_clip < 0:
            raise FederatedConfigError(f"dp-clip must be >= 0, got {self.dp_clip}")

    @classmethod
    def from_node_config(cls, values: Mapping[str, Any]) -> SiteConfig:
        config = _from_mapping(cls, values, "node config")
        if "site-id" not in values and "site_id" not in values and config.partition_id >= 0:
            config.site_id = config.partition_id
        return config

    def to_node_config(self) -> str:
        """The ``--node-config`` string for flower-supernode (TOML values, space separated)."""
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("partition_id", "num_partitions") or value == f.default:
                continue
            rendered = f'"{value}"' if isinstance(value, str) else repr(value)
            parts.append(f"{f.name.replace('_', '-')}={rendered}")
        return " ".join(parts)
