"""``opentinker agent chat|serve``: an LLM agent with tools and memory, in this process or over HTTP.

The agent, its configuration and its service live in ``serving/agent_service.py`` and the LLM area.
"""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.markup import escape

from opentinker.cli.console import cli_errors, console
from opentinker.cli.serve import ApiKey, ApiKeyFile, Host

app = typer.Typer(help="LLM agents: chat with tools and memory, or serve them over HTTP.", no_args_is_help=True)

Llm = Annotated[
    str,
    typer.Option(
        help="'local' (bundled SmolLM2-135M), 'scripted', 'models:/NAME@champion' "
        "(a GRPO-trained adapter) or 'provider:model'."
    ),
]
Tools = Annotated[list[str], typer.Option("--tool", help="Tools to enable (repeat): web_search, python_repl, policy.")]
MemoryWindow = Annotated[int, typer.Option(help="User turns kept verbatim (older ones are summarised).")]


@app.command()
@cli_errors
def chat(
    message: Annotated[str, typer.Argument(help="Your message.")],
    thread: Annotated[str, typer.Option(help="Conversation id; reuse it to continue a conversation.")] = "cli",
    llm: Llm = "local",
    tool: Tools = ["web_search", "python_repl"],  # noqa: B006 — typer needs a literal default
    memory_window: MemoryWindow = 5,
    base_url: Annotated[str | None, typer.Option(help="OpenAI-compatible server URL for --llm.")] = None,
    trace: Annotated[bool, typer.Option(help="Trace the run to MLflow.")] = False,
) -> None:
    """One turn with the agent, in this process; the thread persists under the data dir."""
    from opentinker.serving.agent_service import AgentServiceConfig, build_agent, enable_tracing

    config = AgentServiceConfig(llm=llm, tools=tool, memory_window=memory_window, base_url=base_url)
    if trace:
        enable_tracing()
    agent = build_agent(config)
    started = time.monotonic()
    reply = agent.chat(message, thread)
    for call in reply.tool_calls:
        shown = f"[{call.name} {call.args} -> {call.status}, {call.latency_s or 0:.2f}s] {call.content[:200]}"
        console.print(f"[cyan]{escape(shown)}[/]", highlight=False)
    console.print(reply.text, markup=False, highlight=False)
    console.print(
        f"[bright_black]({reply.input_tokens} in / {reply.output_tokens} out tokens, "
        f"{time.monotonic() - started:.1f}s)[/]",
        highlight=False,
    )


@app.command()
@cli_errors
def serve(
    api_key: ApiKey = None,
    api_key_file: ApiKeyFile = None,
    host: Host = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0 picks a free one).")] = 3001,
    llm: Llm = "local",
    tool: Tools = ["web_search", "python_repl"],  # noqa: B006
    memory_window: MemoryWindow = 5,
) -> None:
    """Serve the agent (BentoML, API-key auth) until Ctrl+C."""
    from opentinker.serving.agent_service import AgentServiceConfig
    from opentinker.serving.foreground import serve_agent_until_stopped

    def ready(service) -> None:
        console.print(f"agent service ready at {service.url} (POST /chat, /history); log: {service.log_path}")

    config = AgentServiceConfig(llm=llm, tools=tool, memory_window=memory_window)
    serve_agent_until_stopped(api_key, api_key_file, config, host, port or None, ready)
