"""Multi-agent training: ``AgentGroup`` (a policy per agent kind) and its ``GroupTrainer`` (see docs/multiagent.md)."""

from opentinker.agents.multiagent.group import ALGORITHMS, AgentGroup
from opentinker.agents.multiagent.trainer import GroupTrainer, KindEvalResult

__all__ = ["ALGORITHMS", "AgentGroup", "GroupTrainer", "KindEvalResult"]
