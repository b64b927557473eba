"""Prefect flows: they only compose tasks from ``opentinker.tasks``.

from opentinker.flows.train import TrainParams, train_flow
result = train_flow(TrainParams(env_id="CartPole-v1", steps=200_000))
"""

import opentinker.tasks  # noqa: F401  (applies Prefect defaults before prefect is imported)
