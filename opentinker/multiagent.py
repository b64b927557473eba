"""``from opentinker.multiagent import AgentGroup``: the article's import path for ``opentinker.agents.multiagent``
(the same objects, re-exported)."""

from opentinker.agents.multiagent import ALGORITHMS, AgentGroup, GroupTrainer, KindEvalResult

__all__ = ["ALGORITHMS", "AgentGroup", "GroupTrainer", "KindEvalResult"]
