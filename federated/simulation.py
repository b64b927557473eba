"""Flower's simulation engine (virtual sites as Ray actors in this process's Ray) for quick experiments."""

from __future__ import annotations

from collections.abc import Sequence

from opentinker.federated.config import FedConfig, SiteConfig
from opentinker.federated.server_app import FederatedResult, build_server_app, read_result


def simulate(
    config: FedConfig, sites: Sequence[SiteConfig] | None = None, cpus_per_site: float = 1.0
) -> FederatedResult:
    """Run `config.num_sites` virtual sites; `sites[i]` gives site i its settings (default: its default variant)."""
    from flwr.simulation import run_simulation

    from opentinker.federated.client_app import build_client_app
    from opentinker.infra.ray_runtime import ensure_ray

    ensure_ray()
    site_configs = list(sites) if sites else [SiteConfig(site_id=i) for i in range(config.num_sites)]
    if len(site_configs) != config.num_sites:
        raise ValueError(f"sites: expected {config.num_sites} site configs (num_sites), got {len(site_configs)}")
    run_simulation(
        server_app=build_server_app(config),
        client_app=build_client_app(site_configs),
        num_supernodes=config.num_sites,
        backend_config={"client_resources": {"num_cpus": cpus_per_site, "num_gpus": 0.0}},
    )
    result = read_result(config)
    if result is None:
        raise RuntimeError(f"simulation of {config.run_name!r} ended without writing its result")
    return result
