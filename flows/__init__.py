"""Prefect flows: they only compose tasks from ``opentinker.tasks``.

from opentinker.tasks import prefect_defaults
from opentinker.tasks.spec import RunSpec
from opentinker.flows.train import train_flow

prefect_defaults()  # once, before the first flow
result = train_flow(RunSpec(env_id="CartPole-v1", steps=200_000))
"""
