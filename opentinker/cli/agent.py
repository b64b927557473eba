"""``opentinker agent chat`` and ``opentinker agent serve``.

Everything heavy (LangChain, transformers, BentoML, MLflow) is imported inside the commands so that
``opentinker --help`` stays fast; the MLflow/BentoML edges live in ``serving/agent_service.py``.
"""

from __future__ import annotations

import time
from typing import Annotated

import typer

app = typer.Typer(help="LLM agents: chat with tools and memory, or serve them over HTTP.", no_args_is_help=True)

Llm = Annotated[
    str,
    typer.Option(
        help="'local' (bundled SmolLM2-135M), 'scripted', 'models:/NAME@champion' "
        "(a GRPO-trained adapter) or 'provider:model'."
    ),
]
Tools = Annotated[list[str], typer.Option("--tool", help="Tools to enable (repeat): web_search, python_repl, policy.")]


@app.command()
def chat(
    message: Annotated[str, typer.Argument(help="Your message.")],
    thread: Annotated[str, typer.Option(help="Conversation id; reuse it to continue a conversation.")] = "cli",
    llm: Llm = "local",
    tool: Tools = ["web_search", "python_repl"],  # noqa: B006 — typer needs a literal default
    memory_window: Annotated[int, typer.Option(help="User turns kept verbatim (older ones are summarised).")] = 5,
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
        typer.secho(
            f"[{call.name} {call.args} -> {call.status}, {call.latency_s or 0:.2f}s] {call.content[:200]}", fg="cyan"
        )
    typer.echo(reply.text)
    typer.secho(
        f"({reply.input_tokens} in / {reply.output_tokens} out tokens, {time.monotonic() - started:.1f}s)",
        fg="bright_black",
    )


@app.command()
def serve(
    api_key: Annotated[
        str | None, typer.Option(help="API key clients must send as 'Authorization: Bearer <key>'.")
    ] = None,
    api_key_file: Annotated[str | None, typer.Option(help="Read the API key from this file.")] = None,
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0 picks a free one).")] = 3001,
    llm: Llm = "local",
    tool: Tools = ["web_search", "python_repl"],  # noqa: B006
    memory_window: Annotated[int, typer.Option(help="User turns kept verbatim.")] = 5,
) -> None:
    """Serve the agent (BentoML, API-key auth) until Ctrl+C."""
    from opentinker.serving.agent_service import serve_agent
    from opentinker.serving.auth import ApiKeyError, resolve_api_key

    try:
        key = resolve_api_key(api_key, api_key_file)
    except ApiKeyError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    service = serve_agent(key, {"llm": llm, "tools": tool, "memory_window": memory_window}, host, port or None)
    typer.echo(f"agent service ready at {service.url} (POST /chat, /history); log: {service.log_path}")
    try:
        service.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        service.stop()
