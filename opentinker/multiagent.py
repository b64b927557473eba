"""``from opentinker.multiagent import AgentGroup``: the article's import path for ``opentinker.agents.multiagent``
(the same objects, re-exported)."""

from opentinker.agents.evaluation import EvalResult
from opentinker.agents.multiagent import ALGORITHMS, AgentGroup, GroupTrainer

__all__ = ["ALGORITHMS", "AgentGroup", "EvalResult", "GroupTrainer"]
