"""Multi-agent training: ``AgentGroup`` (a policy per agent kind) and its ``GroupTrainer`` (see docs/multiagent.md)."""

from opentinker.agents.multiagent.group import ALGORITHMS, AgentGroup
from opentinker.agents.multiagent.trainer import GroupTrainer

__all__ = ["ALGORITHMS", "AgentGroup", "GroupTrainer"]
