"""Prefect flows: they only compose tasks from ``opentinker.tasks``.

from opentinker.tasks import prefect_defaults
from opentinker.flows.train import TrainParams, train_flow

prefect_defaults()  # once, before the first flow
result = train_flow(TrainParams(env_id="CartPole-v1", steps=200_000))
"""
