"""The LLM agent as an HTTP service: ``bentoml serve opentinker.serving.agent_service:AgentService``.

Endpoints (POST, JSON, ``Authorization: Bearer <key>`` — the policy service's auth, ``serving.auth``):
``/chat`` ``{"thread_id", "message"}`` → the reply, the turn's tool calls (ids, status, latency) and token
counts; ``/history`` ``{"thread_id"}`` → the messages still in the memory window and the running summary.
Threads persist in the agent's SQLite checkpointer, so a restarted service continues them.

Configured by ``OPENTINKER_AGENT_CONFIG`` (JSON of ``AgentServiceConfig``, set by ``serve_agent``). This
module is the edge where MLflow tracing (``mlflow.langchain.autolog``: spans per model/tool call, token usage)
is switched on; ``opentinker/llm`` itself never imports MLflow or BentoML.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import bentoml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from opentinker.infra.processes import free_ports

from .auth import ApiKeyMiddleware, hash_api_key
from .deploy import Served, bento_env, start_bento
from .middleware import BodyLimitMiddleware, JsonBodyMiddleware

CONFIG_ENV = "OPENTINKER_AGENT_CONFIG"
POLICY_KEY_ENV = "OPENTINKER_AGENT_POLICY_API_KEY"
SERVICE_IMPORT = "opentinker.serving.agent_service:AgentService"


class AgentServiceConfig(BaseModel):
    """What the agent service runs; handed to the server process as JSON."""

    model_config = ConfigDict(extra="forbid")

    llm: str = Field(
        "local",
        description="'local' (bundled SmolLM2), 'scripted', 'models:/NAME@ALIAS' (a GRPO-trained "
        "adapter) or 'provider:model' for init_chat_model.",
    )
    base_url: str | None = Field(None, description="OpenAI-compatible server (vLLM, Ollama, llama.cpp) for llm.")
    tools: list[Literal["web_search", "python_repl", "policy"]] = Field(
        ["web_search", "python_repl"], description="Tools the agent may call."
    )
    memory_window: int = Field(5, ge=1, le=100, description="User turns kept verbatim; older ones are summarised.")
    checkpoint_db: str | None = Field(
        None, description="SQLite file for threads; default <data_dir>/agents/threads.sqlite."
    )
    max_parallel_tools: int = Field(4, ge=1, le=32, description="Concurrent tool calls per turn.")
    policy_url: str | None = Field(
        None, description="Policy service URL for the 'policy' tool (key: $OPENTINKER_AGENT_POLICY_API_KEY)."
    )
    tracing: bool = Field(True, description="Trace every agent run to MLflow (get_settings().tracking_uri).")


def load_config() -> AgentServiceConfig:
    raw = os.environ.get(CONFIG_ENV, "").strip()
    return AgentServiceConfig.model_validate_json(raw) if raw else AgentServiceConfig()


def enable_tracing(experiment: str | None = None) -> None:
    """Trace LangChain/LangGraph runs to MLflow: one trace per turn, spans per model and tool call with
    latencies, token usage from the models' ``usage_metadata``."""
    from opentinker.infra.settings import get_settings
    from opentinker.tracking.runs import configure_mlflow

    settings = get_settings()
    mlflow = configure_mlflow()
    mlflow.set_experiment(experiment or f"{settings.mlflow_experiment}-agents")
    mlflow.langchain.autolog(log_traces=True, silent=True)


def build_agent(config: AgentServiceConfig):
    """The ``LangChainAgent`` a config describes (also used by ``opentinker agent chat``)."""
    from opentinker.llm import LangChainAgent, PolicyTool, PythonREPL, WebSearch

    tools: list[Any] = []
    for name in config.tools:
        if name == "web_search":
            tools.append(WebSearch())
        elif name == "python_repl":
            tools.append(PythonREPL())
        elif config.policy_url is None:
            raise ValueError("policy_url: required when tools include 'policy'")
        else:
            tools.append(PolicyTool(url=config.policy_url, api_key=os.environ.get(POLICY_KEY_ENV)))
    return LangChainAgent(
        config.llm,
        tools,
        memory_window=config.memory_window,
        base_url=config.base_url,
        checkpointer=config.checkpoint_db,
        max_parallel_tools=config.max_parallel_tools,
    )


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("expected a non-blank message")
    return value


ThreadId = Annotated[
    str,
    Field(
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9_.:-]+$",
        description="Conversation id: 1-128 of A-Z a-z 0-9 _ . : -",
    ),
]
Message = Annotated[
    str,
    Field(min_length=1, max_length=8000, description="The user's message (1-8000 characters)."),
    AfterValidator(_not_blank),
]


class ToolCallOut(BaseModel):
    id: str
    name: str
    args: dict
    status: str
    content: str
    latency_s: float | None


class ChatResponse(BaseModel):
    thread_id: str
    reply: str
    tool_calls: list[ToolCallOut]
    input_tokens: int
    output_tokens: int
    summary: str


@bentoml.service(name="opentinker_agent", workers=1, traffic={"timeout": 600, "max_concurrency": 16})
class AgentService:
    def __init__(self) -> None:
        self.config = load_config()
        if self.config.tracing:
            enable_tracing()
        self.agent = build_agent(self.config)
        if self.config.llm == "local" and not self.config.base_url:
            from opentinker.agents.lm_weights import load_local_weights

            load_local_weights()  # load before /readyz turns green, not on the first request
        elif self.config.llm.startswith("models:/"):
            from opentinker.llm.local_model import load_adapter_weights

            load_adapter_weights(self.config.llm)

    @bentoml.api
    def chat(self, thread_id: ThreadId, message: Message) -> ChatResponse:
        """One user turn on a thread; the agent may call tools (in parallel) before answering."""
        reply = self.agent.chat(message, thread_id)
        calls = [
            ToolCallOut(id=c.id, name=c.name, args=c.args, status=c.status, content=c.content, latency_s=c.latency_s)
            for c in reply.tool_calls
        ]
        return ChatResponse(
            thread_id=thread_id,
            reply=reply.text,
            tool_calls=calls,
            input_tokens=reply.input_tokens,
            output_tokens=reply.output_tokens,
            summary=reply.summary,
        )

    @bentoml.api
    def history(self, thread_id: ThreadId) -> dict[str, Any]:
        """The thread's messages still in the memory window, and the summary of older turns."""
        messages, summary = self.agent.history(thread_id)
        return {
            "thread_id": thread_id,
            "summary": summary,
            "messages": [
                {"type": m.type, "content": m.text, "tool_calls": getattr(m, "tool_calls", [])} for m in messages
            ],
        }


AgentService.add_asgi_middleware(ApiKeyMiddleware)
AgentService.add_asgi_middleware(BodyLimitMiddleware, max_bytes=64 * 1024)
AgentService.add_asgi_middleware(JsonBodyMiddleware)


class AgentDeployment(Served):
    """A running agent service: its URL, ``chat``/``history`` over HTTP, and ``stop()``."""

    def _post(self, path: str, payload: dict) -> dict:
        import httpx

        response = httpx.post(
            f"{self.url}{path}", json=payload, timeout=600, headers={"Authorization": f"Bearer {self._api_key}"}
        )
        response.raise_for_status()
        return response.json()

    def chat(self, thread_id: str, message: str) -> dict:
        return self._post("/chat", {"thread_id": thread_id, "message": message})

    def history(self, thread_id: str) -> dict:
        return self._post("/history", {"thread_id": thread_id})


def serve_agent(
    api_key: str,
    config: AgentServiceConfig | dict | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    log_path: str | Path | None = None,
    ready_timeout_s: float = 240.0,
) -> AgentDeployment:
    """Start ``bentoml serve`` for the agent (free port by default) and wait until ready; the child gets only
    the key's hash. Raises ``serving.deploy.DeploymentError`` with the log tail when it does not start."""
    from opentinker.infra.settings import get_settings

    config = config if isinstance(config, AgentServiceConfig) else AgentServiceConfig.model_validate(config or {})
    port = port or free_ports(1, host)[0]
    log_file = Path(log_path) if log_path else get_settings().resolved_data_dir / "serving" / f"agent-{port}.log"
    env = bento_env(hash_api_key(api_key), {CONFIG_ENV: config.model_dump_json(), "HF_HUB_OFFLINE": "1"})
    service = start_bento("agent service", SERVICE_IMPORT, env, host, port, log_file, ready_timeout_s)
    return AgentDeployment(url=service.url, service=service, log_path=log_file, _api_key=api_key)
