"""The seed API: `FLClient` for a site, `FLServer` for the side that runs the rounds.

site = FLClient(strategy="fedavg", aggregation_interval=300, site_id=0).train(local_data={"pole_length": 0.6})
site = FLClient(site_id=1).train(local_data={"dataset": "site1.npz", "pole_length": 0.6})  # behaviour cloning
result = FLServer(strategy="fedavg", rounds=10, num_sites=3).run()      # against `opentinker federated up`
result = FLServer(rounds=3, num_sites=3).simulate()                     # or Flower's simulation engine
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from opentinker.federated import deploy
from opentinker.federated.config import FedConfig, FederatedConfigError, SiteConfig
from opentinker.federated.server_app import FederatedResult

VARIANT_KEYS = ("pole_length", "gravity")
LOCAL_DATA_KEYS = (*VARIANT_KEYS, "dataset")
LocalData = Mapping[str, Any] | str | os.PathLike | gym.Env | None


def env_variant(env: gym.Env) -> dict[str, float]:
    """A site's CartPole variant given as a gymnasium env (``gym.make("CartPole-v1")`` with ``length``/``gravity``
    changed): its physics parameters; nothing else of the env is used."""
    physics = env.unwrapped
    if not all(hasattr(physics, name) for name in ("length", "gravity")):
        raise FederatedConfigError(
            f"local_data: a gymnasium env must be a CartPole variant (with length and gravity), "
            f"got {type(physics).__name__}"
        )
    return {"pole_length": float(physics.length), "gravity": float(physics.gravity)}


def apply_local_data(site: SiteConfig, local_data: LocalData, site_dir: Path) -> SiteConfig:
    """Put a site's `local_data` into its node config; a dataset is checked here and stays on this machine.

    Accepted: an env variant ``{"pole_length": .., "gravity": ..}`` or a CartPole gymnasium env carrying it; an
    offline dataset (an ``.npz`` path or a mapping of arrays with ``obs``/``actions``); or
    ``{"dataset": <path or arrays>, "pole_length": .., "gravity": ..}`` (the variant is the env the site scores the
    global model on). Arrays are written to ``site_dir/dataset.npz``.
    """
    from opentinker.agents.bc import DatasetError, read_arrays

    if local_data is None:
        return site
    if isinstance(local_data, gym.Env):
        local_data = env_variant(local_data)
    if isinstance(local_data, (str, os.PathLike)) or "obs" in local_data:
        local_data = {"dataset": local_data}
    for key in local_data:
        if key not in LOCAL_DATA_KEYS:
            raise FederatedConfigError(
                f"local_data: unknown key {key!r}; expected an env variant {VARIANT_KEYS} and/or 'dataset' "
                "(an .npz path or a mapping of arrays with 'obs' and 'actions')"
            )
    for key in VARIANT_KEYS:
        if key in local_data:
            setattr(site, key, float(local_data[key]))
    if "dataset" in local_data:
        dataset = local_data["dataset"]
        try:
            arrays = read_arrays(dataset)
        except DatasetError as err:
            raise FederatedConfigError(f"local_data: {err}") from err
        if isinstance(dataset, Mapping):
            site_dir.mkdir(parents=True, exist_ok=True)
            np.savez(site_dir / "dataset.npz", **arrays)
            dataset = site_dir / "dataset.npz"
        site.dataset = str(Path(dataset).resolve())
    return site


def site_configs(sites: int, datasets: list[str]) -> list[SiteConfig]:
    """One config per site; each ``SITE=PATH`` in ``datasets`` makes site SITE train by behaviour cloning on the
    ``.npz`` transitions at PATH (``opentinker federated up --dataset``)."""
    configs = [SiteConfig(site_id=i) for i in range(sites)]
    for item in datasets:
        site, sep, path = item.partition("=")
        if not sep or not site.isdigit() or int(site) >= sites:
            raise FederatedConfigError(f"dataset: {item!r}: expected SITE=PATH with SITE in 0..{sites - 1}")
        apply_local_data(configs[int(site)], path, Path())
    return configs


@dataclass
class SiteHandle:
    """A running site (its flower-supernode process group)."""

    site_id: int
    pid: int
    federation: deploy.Federation

    def stop(self) -> None:
        deploy.stop_site(self.federation, self.site_id)


class FLClient:
    """One site of a federation: trains the global policy on its own data and sends back weights only.

    ``transport``: how the site reaches the SuperLink ("rest": Flower's Fleet API over HTTPS, the one a firewall
    that blocks gRPC lets through; see ``deploy.TRANSPORTS``); ``superlink``: its address (default: the
    federation's). ``aggregation_interval`` is the number of seconds the site trains locally between two
    aggregations (each round it receives the global model, trains for at most that long — and at most the server's
    ``local-steps`` — then replies with its weights and the env steps it took, which weight its share of the average).
    """

    def __init__(
        self,
        strategy: str = "fedavg",
        aggregation_interval: float = 300.0,
        site_id: int = 0,
        federation: str | Path | None = None,
        private_key: str | Path | None = None,
        root_certificates: str | Path | None = None,
        dp_clip: float = 0.0,
        dp_epsilon: float = 1.0,
        dp_delta: float = 1e-5,
        transport: str = "rest",
        superlink: str | None = None,
    ) -> None:
        self.transport = deploy.check_transport(transport)
        self.superlink = superlink
        if aggregation_interval <= 0:
            raise FederatedConfigError(f"aggregation_interval must be > 0 seconds, got {aggregation_interval}")
        self.site = SiteConfig(
            site_id=site_id,
            strategy=strategy,
            aggregation_interval=float(aggregation_interval),
            dp_clip=dp_clip,
            dp_epsilon=dp_epsilon,
            dp_delta=dp_delta,
        )
        self.federation_root, self.private_key, self.root_certificates = federation, private_key, root_certificates

    def train(self, local_data: LocalData = None, connect_timeout: float = 180.0) -> SiteHandle:
        """Join the federation with `local_data`: this site's env variant (``{"pole_length": .., "gravity": ..}``,
        local PPO) or an offline transition dataset (behaviour cloning), see ``apply_local_data``.

        Starts the site's SuperNode (TLS, authenticated with the site's private key) and returns once the SuperLink
        has accepted it; the site then takes part in every round until ``stop()``.
        """
        fed = deploy.Federation.load(self.federation_root)
        apply_local_data(self.site, local_data, Path(fed.root) / f"site-{self.site.site_id}")
        pid = deploy.start_site(
            fed,
            self.site,
            private_key=Path(self.private_key) if self.private_key else None,
            root_cert=Path(self.root_certificates) if self.root_certificates else None,
            timeout=connect_timeout,
            address=self.superlink,
            transport=self.transport,
        )
        return SiteHandle(self.site.site_id, pid, fed)


class FLServer:
    """Runs N rounds over the sites: ``FLServer(strategy="fedprox", rounds=5, min_completion_rate=0.66)``."""

    def __init__(self, strategy: str = "fedavg", rounds: int = 3, transport: str = "rest", **settings: Any) -> None:
        self.transport = deploy.check_transport(transport)
        self.config = FedConfig(strategy=strategy, num_server_rounds=rounds, **settings)

    def run(self, federation: str | Path | None = None, timeout: float = 3600.0) -> FederatedResult:
        """Submit the run to a deployed federation (`opentinker federated up`) and wait for its result."""
        return deploy.submit(deploy.Federation.load(federation), self.config, timeout=timeout)

    def simulate(self, sites: list[SiteConfig] | None = None) -> FederatedResult:
        from opentinker.federated.simulation import simulate

        return simulate(self.config, sites)
