"""``LocalChatModel``: the bundled SmolLM2-135M-Instruct as a LangChain chat model with real tool calling.

A 135M model does not follow a tool-calling convention on its own, so the format is made strict:
- the prompt lists the tools and shows a worked example of the tool-call format (``envs/tool_calls.py``);
- decoding is greedy (deterministic) and constrained where it matters: inside ``"name": "`` only a bound tool
  name can be produced, then the ``"arguments"`` key is forced; ``tool_choice`` forces a call outright;
- the text is parsed into ``AIMessage.tool_calls`` (or ``invalid_tool_calls`` when the JSON is broken), several
  ``<tool_call>`` blocks in one reply being parallel calls. Tool results are shown back as ``<tool_result>`` blocks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.utils.function_calling import convert_to_openai_tool

from opentinker.agents.lm_weights import load_local_weights
from opentinker.envs.tool_calls import CLOSE, OPEN, parse_reply, system_message, tool_result, worked_examples

_NAME_KEY = '{"name": "'


class LocalChatModel(BaseChatModel):
    """SmolLM2-135M-Instruct run in-process with transformers (weights loaded once per process)."""

    gguf_path: str | None = None
    """A GGUF file to run instead of the bundled SmolLM2 (any llama-architecture chat model)."""
    cache_dir: str | None = None
    """Where the de-quantised checkpoint is cached; default ``<data_dir>/llm-cache``."""
    max_new_tokens: int = 64
    """Generation cap per reply (keeps latency bounded on CPU)."""
    num_threads: int | None = 1
    """torch intra-op threads for this process (see ``load_local_weights``); None leaves torch's default."""
    max_tool_result_chars: int = 500
    """Tool output shown to the model is cut to this many characters (prompt length = latency)."""
    examples: bool = True
    """Show a worked tool-call exchange per tool before the conversation (few-shot for the untrained model)."""
    tool_specs: tuple[dict, ...] = ()
    tool_choice: str | None = None

    @property
    def _llm_type(self) -> str:
        return "opentinker-local-smollm2"

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None, **kwargs: Any) -> LocalChatModel:
        specs = tuple(convert_to_openai_tool(t)["function"] for t in tools)
        if isinstance(tool_choice, dict):
            tool_choice = tool_choice.get("function", {}).get("name") or tool_choice.get("name")
        if tool_choice in ("auto", "none", False, None):
            tool_choice = None if tool_choice != "none" else "none"
        return self.model_copy(update={"tool_specs": specs, "tool_choice": tool_choice})

    def _generate(
        self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: Any = None, **kwargs: Any
    ) -> ChatResult:
        weights = load_local_weights(self.gguf_path, self.cache_dir, self.num_threads)
        tools = () if self.tool_choice == "none" else self.tool_specs
        chat, n_fixed = self._render(messages, tools)
        names = [t["name"] for t in tools]
        forced = None
        if tools and self.tool_choice:
            forced = self.tool_choice if self.tool_choice in names else None
            spec = next((t for t in tools if t["name"] == forced), None)
            forced = (
                OPEN
                + _NAME_KEY
                + (f'{forced}"' + _arguments_prefix(spec["parameters"].get("properties", {})) if spec else "")
            )
        with weights.lock:
            text, n_in, n_out = _decode(weights, chat, n_fixed, names, tools, forced, self.max_new_tokens)
        message = parse_reply(text, names)
        message.usage_metadata = {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}
        message.response_metadata = {"model_name": "SmolLM2-135M-Instruct", "finish_reason": "stop"}
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _render(self, messages: Sequence[BaseMessage], tools: Sequence[dict]) -> tuple[list[dict], int]:
        """LangChain messages as ChatML turns (tool calls/results in the strict text format), and how many
        leading turns are fixed (system prompt + examples: their KV cache is reused)."""
        system = "\n\n".join(_text(m) for m in messages if isinstance(m, SystemMessage))
        chat = [{"role": "system", "content": system_message(tools, system)}]
        chat += worked_examples(tools) if self.examples else []
        n_fixed = len(chat)
        for message in messages:
            if isinstance(message, HumanMessage):
                chat.append({"role": "user", "content": _text(message)})
            elif isinstance(message, AIMessage):
                calls = "".join(
                    f"{OPEN}{json.dumps({'name': c['name'], 'arguments': c['args']})}{CLOSE}"
                    for c in message.tool_calls
                )
                chat.append({"role": "assistant", "content": (_text(message) + calls).strip()})
            elif isinstance(message, ToolMessage):
                block = tool_result(message.name, _text(message)[: self.max_tool_result_chars])
                if chat[-1]["role"] == "user" and chat[-1]["content"].startswith("<tool_result"):
                    chat[-1]["content"] += "\n" + block
                else:
                    chat.append({"role": "user", "content": block})
        return chat, n_fixed


def _decode(
    weights: Any,
    chat: list[dict],
    n_fixed: int,
    names: list[str],
    tools: Sequence[dict],
    forced_prefix: str | None,
    max_new_tokens: int,
) -> tuple[str, int, int]:
    """Greedy decoding under the tool-call grammar; returns (text, prompt tokens, generated tokens).

    Whatever the grammar fixes (the JSON keys, the rest of a tool name once it is unambiguous, the closing
    braces) is forced and fed in one forward pass, so the model only spends sequential steps on real choices.
    The KV cache of the first ``n_fixed`` messages (system prompt + examples) is kept between calls.
    """
    import torch

    model, tok = weights.model, weights.tokenizer
    prompt_ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    eos = {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}
    params = {t["name"]: t.get("parameters", {}).get("properties", {}) for t in tools}
    out_ids = tok.encode(forced_prefix, add_special_tokens=False) if forced_prefix else []
    text = forced_prefix or ""
    cache, cached_len = _prefix_cache(
        weights, tok.apply_chat_template(chat[:n_fixed], tokenize=True, return_dict=True)["input_ids"], prompt_ids
    )
    feed = torch.cat([prompt_ids, torch.tensor([out_ids], dtype=prompt_ids.dtype)], dim=1)[:, cached_len:]
    try:
        with torch.no_grad():
            while len(out_ids) < max_new_tokens:
                result = model(input_ids=feed, cache=cache, use_cache=True, logits_to_keep=1)
                cache, logits = result.cache, result.logits[0, -1]
                token = _choose(tok, logits, text, names) if params else int(logits.argmax())
                if token in eos:
                    break
                step = [token]
                text = tok.decode(out_ids + step, skip_special_tokens=True)
                if params and (forced := _grammar_continuation(text, params)):
                    step += tok.encode(forced, add_special_tokens=False)
                    text += forced
                out_ids += step
                feed = torch.tensor([step])
                if _finished(text):
                    break
    finally:
        if cache is not None and cached_len and (extra := cache.get_seq_length() - cached_len) > 0:
            cache.crop(-extra)  # back to the shared prefix for the next call
    return _trim(text), int(prompt_ids.shape[1]), len(out_ids)


def _prefix_cache(weights: Any, prefix_ids: list[int], prompt_ids: Any) -> tuple[Any, int]:
    """A KV cache holding ``prefix_ids`` (computed once, LRU of 4); (None, 0) when the prompt does not start with it."""
    import torch

    if prompt_ids[0, : len(prefix_ids)].tolist() != list(prefix_ids):
        return None, 0
    key = tuple(prefix_ids)
    caches = weights.prefix_caches
    if key not in caches:
        with torch.no_grad():
            caches[key] = weights.model(input_ids=torch.tensor([prefix_ids]), use_cache=True, logits_to_keep=1).cache
        while len(caches) > 4:
            caches.pop(next(iter(caches)))
    caches[key] = caches.pop(key)  # most recently used last
    return caches[key], len(prefix_ids)


def _open_block(text: str) -> str | None:
    """The text of the tool-call block being written, or None outside a block."""
    start = text.rfind(OPEN)
    if start < 0 or CLOSE in text[start:]:
        return None
    return text[start + len(OPEN) :]


def _open_name(text: str) -> str | None:
    """The partial tool name being written, when decoding is inside ``"name": "``; else None."""
    block = _open_block(text)
    if block is None or not block.startswith(_NAME_KEY):
        return None
    partial = block[len(_NAME_KEY) :]
    return None if '"' in partial else partial


def _choose(tok: Any, logits: Any, text: str, names: list[str]) -> int:
    """Greedy token, restricted to continuations of a bound tool name while a name is being written."""
    partial = _open_name(text)
    if partial is None:
        return int(logits.argmax())
    for token in logits.topk(64).indices.tolist():
        candidate = partial + tok.decode([token])
        if any(n.startswith(candidate) for n in names):
            return token
    best = next((n for n in names if n.startswith(partial) and n != partial), names[0])
    return tok.encode(best[len(partial) :], add_special_tokens=False)[0]


def _grammar_continuation(text: str, params: dict[str, dict]) -> str:
    """The characters the tool-call grammar fixes after ``text`` ("" when the model must choose)."""
    stripped = text.lstrip()
    if stripped and OPEN.startswith(stripped) and stripped != OPEN:
        return OPEN[len(stripped) :] + _NAME_KEY  # a reply that starts with "<" is a tool call
    block = _open_block(text)
    if block is None:
        return ""
    if block == "":
        return _NAME_KEY
    partial = _open_name(text)
    if partial is not None:
        matches = [n for n in params if n.startswith(partial)]
        return "" if len(matches) != 1 else matches[0][len(partial) :] + '"' + _arguments_prefix(params[matches[0]])
    match = re.fullmatch(r'\{"name": "([\w-]+)", "arguments": \{"(\w+)": "((?:[^"\\]|\\.)*)"', block)
    if match and len(params.get(match.group(1), {})) == 1:
        return "}}" + CLOSE  # the only (string) argument is closed: the call is complete
    return ""


def _arguments_prefix(properties: dict) -> str:
    """``, "arguments": {`` plus the key and opening quote when the tool takes exactly one string."""
    forced = ', "arguments": {'
    if len(properties) == 1:
        key, schema = next(iter(properties.items()))
        forced += f'"{key}": ' + ('"' if schema.get("type") == "string" else "")
    return forced


def _finished(text: str) -> bool:
    """Stop after the last tool call block once the model writes anything but another block."""
    end = text.rfind(CLOSE)
    if end < 0:
        return False
    rest = text[end + len(CLOSE) :].strip()
    return bool(rest) and not (OPEN.startswith(rest) or rest.startswith(OPEN))


def _trim(text: str) -> str:
    end = text.rfind(CLOSE)
    if end >= 0 and not text[end + len(CLOSE) :].strip().startswith(OPEN):
        return text[: end + len(CLOSE)]
    return text.strip()


def _text(message: BaseMessage) -> str:
    return message.content if isinstance(message.content, str) else message.text


class AdapterChatModel(LocalChatModel):
    """A GRPO-trained LoRA adapter on its base model (``models:/NAME@champion`` or an adapter folder), served as
    it was trained: the same prompt (no worked examples) and plain greedy decoding — no constrained grammar."""

    model_uri: str
    """``models:/NAME@ALIAS``, ``models:/NAME/VERSION`` or a local adapter folder (``policy.save_adapter``)."""
    examples: bool = False
    max_new_tokens: int = 0
    """0: the ``max_new_tokens`` the adapter was trained with."""

    @property
    def _llm_type(self) -> str:
        return "opentinker-lora-adapter"

    def _generate(
        self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager: Any = None, **kwargs: Any
    ) -> ChatResult:
        weights, meta = load_adapter_weights(self.model_uri, self.cache_dir, self.num_threads)
        tools = () if self.tool_choice == "none" else self.tool_specs
        chat, n_fixed = self._render(messages, tools)
        with weights.lock:
            text, n_in, n_out = _decode(
                weights, chat, n_fixed, [], (), None, self.max_new_tokens or int(meta.get("max_new_tokens", 64))
            )
        message = parse_reply(text, [t["name"] for t in tools])
        message.usage_metadata = {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}
        message.response_metadata = {
            "model_name": f"{meta['base_model']}+lora",
            "model_uri": self.model_uri,
            "model_version": meta.get("version", ""),
            "finish_reason": "stop",
        }
        return ChatResult(generations=[ChatGeneration(message=message)])


_ADAPTERS: dict[str, tuple[Any, dict]] = {}


def load_adapter_weights(model_uri: str, cache_dir: str | None = None, num_threads: int | None = 1) -> tuple[Any, dict]:
    """(LocalWeights of base + merged adapter, the adapter's metadata), loaded once per process and URI.

    A registry URI is resolved and downloaded through ``tracking.llm_store`` (the registry, below this area)."""
    import threading

    import torch

    from opentinker.agents.lm_policy import load_adapted_model
    from opentinker.agents.lm_weights import LocalWeights

    if model_uri not in _ADAPTERS:
        from opentinker.tracking.llm_store import download_adapter

        ref, folder = download_adapter(model_uri)
        if num_threads:
            torch.set_num_threads(num_threads)
        model, tokenizer, meta = load_adapted_model(folder, cache_dir)
        weights = LocalWeights(model=model, tokenizer=tokenizer, source=model_uri, lock=threading.Lock())
        _ADAPTERS[model_uri] = (weights, {**meta, "version": ref.version})
    return _ADAPTERS[model_uri]
