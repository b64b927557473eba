"""LLM agents on LangChain 1.x / LangGraph: ``LangChainAgent`` with tools, rolling memory and persisted threads.

``from opentinker.llm import LangChainAgent, WebSearch, PythonREPL`` (the article's import). Its own area above the
RL core: it uses the trainable LM policy of ``agents/`` and the tool-call format of ``envs/``, never the reverse;
it never imports MLflow, BentoML or Ray (tracing and serving are wired at the edge, in ``serving/agent_service.py``).
The scripted test model (``opentinker.llm.scripted_model``, ``llm="scripted"``) is a test double, not exported.
"""

from .agent import AgentReply, LangChainAgent, ToolCallRecord, ToolGuardMiddleware
from .local_model import LocalChatModel
from .memory import RollingMemoryMiddleware, extractive_summary, llm_summarizer
from .models import resolve_chat_model
from .sandbox import SandboxLimits, SandboxResult, SandboxUnavailable, run_python
from .search import LocalDocsBackend, SearchBackend, SearchHit
from .tools import PolicyTool, PythonREPL, WebSearch

__all__ = [
    "AgentReply",
    "LangChainAgent",
    "LocalChatModel",
    "LocalDocsBackend",
    "PolicyTool",
    "PythonREPL",
    "RollingMemoryMiddleware",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "SearchBackend",
    "SearchHit",
    "ToolCallRecord",
    "ToolGuardMiddleware",
    "WebSearch",
    "extractive_summary",
    "llm_summarizer",
    "resolve_chat_model",
    "run_python",
]
