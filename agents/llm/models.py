"""Turn the ``llm=`` option into a LangChain chat model.

- a ``BaseChatModel`` instance is used as is;
- ``"local"`` (the default) is the bundled SmolLM2-135M run in-process (``LocalChatModel``);
- ``"scripted"`` is the deterministic ``ScriptedChatModel`` (tests, demos);
- ``"models:/NAME@ALIAS"`` (or ``/VERSION``) is a GRPO-trained LoRA adapter from the registry on its base model
  (``AdapterChatModel``: greedy, no constrained decoding);
- ``"provider:model"`` (``"openai:gpt-4o"``, ``"anthropic:claude-sonnet-4-5"``, ...) goes through LangChain's
  ``init_chat_model`` (the provider's integration package must be installed);
- with ``base_url`` the model is reached through an OpenAI-compatible server (vLLM, Ollama, llama.cpp server).
"""
from __future__ import annotations

from typing import Any

from langchain_core.language_models import BaseChatModel

LOCAL_NAMES = frozenset({"local", "smollm2", "local:smollm2"})


def resolve_chat_model(llm: str | BaseChatModel | None = "local", *, base_url: str | None = None,
                       api_key: str | None = None, **model_kwargs: Any) -> BaseChatModel:
    """The chat model for ``llm`` (see the module docstring); errors name the option and what was expected."""
    if isinstance(llm, BaseChatModel):
        return llm
    if llm is None or (isinstance(llm, str) and llm.strip().lower() in LOCAL_NAMES and not base_url):
        from .local_model import LocalChatModel

        return LocalChatModel(**model_kwargs)
    if not isinstance(llm, str) or not llm.strip():
        raise ValueError(f"llm: expected a chat model, 'local', 'scripted' or 'provider:model', got {llm!r}")
    if llm.startswith("models:/"):
        from .local_model import AdapterChatModel

        return AdapterChatModel(model_uri=llm, **model_kwargs)
    if llm.strip().lower() == "scripted":
        from .scripted_model import ScriptedChatModel

        return ScriptedChatModel(**model_kwargs)
    from langchain.chat_models import init_chat_model

    if base_url:
        provider, _, name = llm.partition(":") if ":" in llm else ("openai", "", llm)
        extra = {"api_key": api_key or "not-needed"}
        return init_chat_model(name, model_provider=provider, base_url=base_url, **extra, **model_kwargs)
    if ":" not in llm:
        raise ValueError(f"llm: expected 'provider:model' (e.g. 'openai:gpt-4o') or base_url for a local server, got {llm!r}")
    if api_key:
        model_kwargs["api_key"] = api_key
    return init_chat_model(llm, **model_kwargs)
