"""``from opentinker.llm import LangChainAgent``: the article's import path for ``opentinker.agents.llm``
(the same objects, re-exported)."""

from opentinker.agents.llm import LangChainAgent, LocalChatModel, PolicyTool, PythonREPL, WebSearch, resolve_chat_model

__all__ = ["LangChainAgent", "LocalChatModel", "PolicyTool", "PythonREPL", "WebSearch", "resolve_chat_model"]
