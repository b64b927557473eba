"""Turn the ``llm=`` option into a LangChain chat model.

- a ``BaseChatModel`` instance is used as is;
- ``"local"`` (the default) is the bundled SmolLM2-135M run in-process (``LocalChatModel``);
- ``"scripted"`` is the deterministic ``ScriptedChatModel`` (tests, demos);
- ``"models:/NAME@ALIAS"`` (or ``/VERSION``) is a GRPO-trained LoRA adapter from the registry on its base model
  (``AdapterChatModel``: greedy, no constrained decoding);
- ``"provider:model"`` (``"openai:gpt-4o"``, ``"anthropic:claude-sonnet-4-5"``, ...) or a bare model name LangChain
  knows (``"gpt-4"`` -> openai, ``"claude-..."`` -> anthropic) goes through LangChain's ``init_chat_model``; the
  provider's integration package and key must be configured, else the error says which, and how to run offline;
- with ``base_url`` the model is reached through an OpenAI-compatible server (vLLM, Ollama, llama.cpp server).
"""

from __future__ import annotations

from typing import Any

from langchain_core.language_models import BaseChatModel

LOCAL_NAMES = frozenset({"local", "smollm2", "local:smollm2"})


def resolve_chat_model(
    llm: str | BaseChatModel | None = "local",
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    **model_kwargs: Any,
) -> BaseChatModel:
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
    if api_key:
        model_kwargs["api_key"] = api_key
    try:
        return init_chat_model(llm, **model_kwargs)
    except Exception as exc:  # missing package (ImportError), unknown name (ValueError), or the SDK's missing-key error
        raise ValueError(f"llm={llm!r} cannot be used here: {exc}. {OFFLINE_HINT}") from exc


OFFLINE_HINT = (
    "Configure the hosted provider (install its LangChain package, e.g. `pip install langchain-openai`, "
    "and set its key, e.g. OPENAI_API_KEY), point base_url= at an OpenAI-compatible server, or use the "
    "bundled local model that runs offline: llm='local' (SmolLM2-135M-Instruct)."
)
