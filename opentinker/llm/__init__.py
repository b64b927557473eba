"""LLM agents on LangChain 1.x / LangGraph: ``LangChainAgent`` with tools, rolling memory and persisted threads.

The one part of ``agents/`` that imports LangChain/transformers; it never imports MLflow, BentoML or Ray
(tracing and serving are wired at the edge, in ``serving/agent_service.py``).
"""

from .agent import AgentReply, LangChainAgent, ToolCallRecord, ToolGuardMiddleware
from .local_model import LocalChatModel
from .memory import RollingMemoryMiddleware, extractive_summary, llm_summarizer
from .models import resolve_chat_model
from .sandbox import SandboxLimits, SandboxResult, SandboxUnavailable, run_python
from .scripted_model import ScriptedChatModel, command_script
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
    "ScriptedChatModel",
    "SearchBackend",
    "SearchHit",
    "ToolCallRecord",
    "ToolGuardMiddleware",
    "WebSearch",
    "command_script",
    "extractive_summary",
    "llm_summarizer",
    "resolve_chat_model",
    "run_python",
]
